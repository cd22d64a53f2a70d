"""Model architectures, written over the parallel layers and the paged attention layer;
each class reads its own config, and `registry.model_class` finds it by the Hugging Face
architecture names it declares."""
