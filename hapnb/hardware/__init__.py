"""What the programs run on: device models (:mod:`~hapnb.hardware.devices`: peak rates, kernel times,
efficiency curves, the H100 fit) and clusters (:mod:`~hapnb.hardware.cluster`: devices, links,
collective costs, presets, the spec parser and the cluster JSON)."""
