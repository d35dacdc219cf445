"""Plain data and errors the whole project shares: the MimoError family, PackedBatch, the YAML schema helpers, the reference-discipline comparisons (a base package)."""
