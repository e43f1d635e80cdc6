"""The two tasks end to end: :mod:`.translate` (train, load and evaluate a translator) and
:mod:`.lm` (train a GPT, sample from it, draw its attention), both run through the one
training skeleton in :mod:`.pipeline`."""
