"""Input pipelines: sharded TFRecord reading and writing."""

from tputrain.data.context import InputContext
from tputrain.data.tfrecord import TFRecordInput, parse_feature_spec
from tputrain.data.writer import feature_spec_for, write_tfrecords

__all__ = [
    "InputContext",
    "TFRecordInput",
    "feature_spec_for",
    "parse_feature_spec",
    "write_tfrecords",
]
