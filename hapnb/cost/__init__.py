"""What a program costs: the one cost model (:mod:`~hapnb.cost.model`: a step's computation,
communication and optimizer time per device, with the collectives of buffer updates from
:mod:`~hapnb.cost.buffers`) and the one memory model (:mod:`~hapnb.cost.memory`:
parameters, gradients, optimizer states, saved activations and transients per device)."""
