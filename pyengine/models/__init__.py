"""Model architectures, written over the parallel layers and the paged attention layer;
`registry.model_class` finds one by its Hugging Face architecture name."""
