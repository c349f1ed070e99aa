"""The values everything else is written in: tensor forms and shard lengths (:mod:`~hapnb.ir.forms`)
and the graph IR a traced model becomes (:mod:`~hapnb.ir.graph`). Imports nothing of hapnb above it."""
