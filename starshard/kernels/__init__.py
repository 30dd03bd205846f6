from starshard.kernels.attention import attention

__all__ = ["attention"]
