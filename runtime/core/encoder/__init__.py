"""The encoder cache: which multimodal encoder outputs are held, and by which requests."""
