"""The communication layer, one way down: ``grads`` and ``params`` (what a step moves) over
``wires`` (how a bucket's gradient is summed), over ``codec`` (8-bit blocks, pure tensors) and
``ops`` (one torch.distributed call each, and the byte accounting)."""
