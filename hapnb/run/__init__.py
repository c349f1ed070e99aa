"""The run layer: rank programs executed on real processes.

One module per job, imports pointing down this list: :mod:`~hapnb.run.calibrate` (predicted vs measured
time) over :mod:`~hapnb.run.launch` (``hapnb launch``), :mod:`~hapnb.run.verify` (against one device),
:mod:`~hapnb.run.distribute` (``distribute`` under torchrun) over :mod:`~hapnb.run.training` (its data sampler,
global loss and gradient clipping, the rank agreement check), :mod:`~hapnb.run.profile` (devices and
collectives -> cluster JSON), :mod:`~hapnb.run.worker` (one rank of a bundle), :mod:`~hapnb.run.bundle`
(plan + exported program in a folder), and at the bottom :mod:`~hapnb.run.supervisor`, the one process
supervisor that starts and watches every rank process. Pipeline plans run through
:mod:`~hapnb.run.pipelined` (ranks, the schedule, verify/launch's entry) over :mod:`~hapnb.run.pipestage`
(the cut model and data-parallel stages).
"""
