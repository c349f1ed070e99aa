"""The values everything else is written in: tensor forms and shard lengths (:mod:`~hapnb.ir.forms`),
the graph IR a traced model becomes (:mod:`~hapnb.ir.graph`) and HAP's collective instructions
(:mod:`~hapnb.ir.collective_table`). Imports nothing of hapnb above it."""
