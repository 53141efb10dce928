"""FlashInfer backend: the backend, its persistent buffers, host writes and graph slot math."""

from chunklocal.backends.flashinfer.backend import FlashInferBackend

__all__ = ["FlashInferBackend"]
