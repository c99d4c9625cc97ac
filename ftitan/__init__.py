"""ftitan: a functional, JAX-style PyTorch platform for LLMs."""
