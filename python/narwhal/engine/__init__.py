"""LexiEngine: one resident GGUF model served over llama-cpp-python."""
