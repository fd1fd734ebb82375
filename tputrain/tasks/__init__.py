"""Built-in tasks used by the configs in `configs/` (and as examples of `Task`)."""

from tputrain.tasks.classifier import MLPClassifierTask
from tputrain.tasks.digits import DigitsTask
from tputrain.tasks.keras_hub_lm import KerasHubLMTask
from tputrain.tasks.text_lm import TextLMTask
from tputrain.tasks.transformer import SyntheticLMTask

__all__ = ["DigitsTask", "KerasHubLMTask", "MLPClassifierTask", "SyntheticLMTask", "TextLMTask"]
