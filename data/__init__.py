"""WebDataset shards to layout-independent packed microbatches."""
