"""Model architectures, written over the paged attention layer."""
