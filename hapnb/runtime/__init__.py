"""From a plan to running programs: rank programs (:mod:`~hapnb.runtime.codegen`, torch.fx), the
uneven collectives they call with their autograd duals (:mod:`~hapnb.runtime.collectives`), batch
norm's running-statistics updates (:mod:`~hapnb.runtime.bufferupdates`), the seeded stream their random ops
draw from, the same on every rank and on one device (:mod:`~hapnb.runtime.random_stream`), and the expansion of virtual
devices into physical GPUs (:mod:`~hapnb.runtime.expand`). Processes, bundles and launching are in
:mod:`hapnb.run`."""
