"""What each head does: record and replace activations (:mod:`.capture`), score every
head (:mod:`.scores`), ablate and patch heads (:mod:`.interventions`), and watch an
induction head form (:mod:`.induction`). See docs/heads.md."""

from .capture import ActivationCache, capture, intervene, layer_names

__all__ = ["ActivationCache", "capture", "intervene", "layer_names"]
