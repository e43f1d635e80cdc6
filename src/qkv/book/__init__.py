"""The books' own forms: *Build a Large Language Model (From Scratch)* ch. 3's teaching
classes (:mod:`.self_attention`) and its step-by-step walkthrough (:mod:`.walkthrough`).

Both build only on the attention core (:mod:`qkv.functional`, :class:`qkv.MultiHeadAttention`).
"""
