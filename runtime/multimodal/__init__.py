"""Multimodal inputs in the shell: image preprocessing, content hashes and placeholder layout."""
