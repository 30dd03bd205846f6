"""The model layer for one device: the decoder (model.py), its KV cache and sampling. Nothing here
imports torch.distributed or anything above it; parallelism is applied from outside."""
