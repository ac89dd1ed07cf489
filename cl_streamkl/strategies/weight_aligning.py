"""Weight aligning (Zhao et al. 2020), the exemplar-free correction of a classifier's bias toward new classes.

Training on new classes alone makes their classifier weights larger than the old
classes', so new classes win the argmax. After each experience, weight aligning
rescales the new classes' weight vectors (and biases) by
``gamma = mean ‖w_old‖ / mean ‖w_new‖``: the new classes' logits shrink by ``gamma``
and the two groups compete on an equal footing. No stored examples are needed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from avalanche.training.plugins import SupervisedPlugin
from torch import nn

from cl_streamkl.distributed import unwrap_data_parallel

__all__ = ["WeightAlignPlugin", "align_weights"]


@torch.no_grad()
def align_weights(classifier: nn.Linear, old_classes: Iterable[int], new_classes: Iterable[int]) -> float:
    """Scale the rows of ``new_classes`` so their mean weight norm equals that of ``old_classes``.

    Args:
        classifier: the shared linear head, weight (num_classes, features).
        old_classes: classes learned in earlier experiences.
        new_classes: classes of the experience just learned.

    Returns:
        The factor ``gamma`` applied to the new classes' weights and biases (1.0 when
        either group is empty).
    """
    if not isinstance(classifier, nn.Linear):
        raise TypeError(f"weight aligning needs a linear classifier, got {type(classifier).__name__}")
    old, new = sorted(set(old_classes)), sorted(set(new_classes))
    if not old or not new:
        return 1.0
    norms = classifier.weight.float().norm(dim=1)
    gamma = float(norms[old].mean() / norms[new].mean())
    classifier.weight[new] *= gamma
    if classifier.bias is not None:
        classifier.bias[new] *= gamma
    return gamma


def _classifier(model: nn.Module) -> nn.Linear:
    model = unwrap_data_parallel(model)
    get_classifier = getattr(model, "get_classifier", None)
    head = get_classifier() if callable(get_classifier) else None
    if not isinstance(head, nn.Linear):
        raise TypeError(f"weight aligning needs a model with one shared linear classifier "
                        f"(timm's get_classifier()); {type(model).__name__} has {type(head).__name__}")
    return head


class WeightAlignPlugin(SupervisedPlugin, supports_distributed=True):
    """Avalanche plugin: :func:`align_weights` after every training experience.

    Put it before plugins that snapshot the model after an experience (LwF, StreamKL),
    so their teachers are the aligned model, as in the original method. In a data-parallel
    run every rank aligns its identical replica the same way, so the replicas stay equal.

    Attributes:
        seen_classes: every class trained so far (saved by :meth:`state_dict`).
        gammas: the factor applied after each experience (1.0 after the first).
    """

    def __init__(self) -> None:
        super().__init__()
        self.seen_classes: list[int] = []
        self.gammas: list[float] = []

    def before_training(self, strategy: Any, **kwargs: Any) -> None:
        _classifier(strategy.model)

    def after_training_exp(self, strategy: Any, **kwargs: Any) -> None:
        current = {int(c) for c in strategy.experience.dataset.targets.uniques}
        new = current - set(self.seen_classes)
        self.gammas.append(align_weights(_classifier(strategy.model), self.seen_classes, new))
        self.seen_classes = sorted(set(self.seen_classes) | current)

    def state_dict(self) -> dict[str, Any]:
        return {"seen_classes": list(self.seen_classes), "gammas": list(self.gammas)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen_classes = [int(c) for c in state["seen_classes"]]
        self.gammas = [float(g) for g in state["gammas"]]
