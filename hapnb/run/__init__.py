"""The run layer: rank programs executed on real processes (verify, distribute, launch, profile)."""
