"""The books' own forms: *Build a Large Language Model (From Scratch)* ch. 3's teaching
classes (:mod:`.self_attention`), its step-by-step walkthrough (:mod:`.walkthrough`) and
its bonus material's fused-projection attention (:mod:`.efficient_attention`).

All build only on the attention core (:mod:`qkv.functional`, :class:`qkv.MultiHeadAttention`).
"""
