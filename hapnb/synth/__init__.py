"""Synthesis: the A* search for the program Q at fixed ratios, its tables and admissible bounds, memory
pruning, the ratio LP B, their alternation, and HiDup's duplex objective (docs/architecture.md §2).

* :mod:`~hapnb.synth.spec` what a search is asked and answers, :mod:`~hapnb.synth.tables` the
  ratio-independent tables, :mod:`~hapnb.synth.search` the A* itself;
* the A* heuristic: :mod:`~hapnb.synth.heuristic` (the spine DP), :mod:`~hapnb.synth.heuristic_side`
  (side consumers, branches, tied parameters), :mod:`~hapnb.synth.heuristic_rejoin` (spine tensors that
  rejoin the spine), :mod:`~hapnb.synth.chain_bound` (the stronger bound for long searches);
* :mod:`~hapnb.synth.memory_prune` partial programs that cannot fit and how replicated parameters are
  stored; :mod:`~hapnb.synth.balance` the ratio LP; :mod:`~hapnb.synth.optimize` the Q/B loop;
  :mod:`~hapnb.synth.duplex` the duplex objective.
"""
