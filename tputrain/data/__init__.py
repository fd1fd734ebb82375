"""Input pipelines: sharded TFRecord and TFDS reading, TFRecord writing, tf.data options,
augmentation that resumes exactly."""

from tputrain.data.augment import stateless_augment
from tputrain.data.bad_records import CorruptRecordError, explain_data_loss
from tputrain.data.batching import pad_to_batch
from tputrain.data.bigram import bigram_bits_per_byte
from tputrain.data.bucketing import bucket_by_length
from tputrain.data.context import InputContext
from tputrain.data.external_state import InputStateError
from tputrain.data.feature_check import FeatureSpecError, explain_parse_error
from tputrain.data.manifest import Manifest, read_manifest
from tputrain.data.mixture import MixtureInput, mix_datasets, source_counts
from tputrain.data.options import InputOptions
from tputrain.data.packing import PackSequences, pack_sequences
from tputrain.data.padding import PadSequences, pad_sequences
from tputrain.data.tfds import TFDSInput
from tputrain.data.text_corpus import TextCorpus, stdlib_files, write_text_corpus
from tputrain.data.tfrecord import TFRecordInput, parse_feature_spec
from tputrain.data.writer import feature_spec_for, write_tfrecords

__all__ = [
    "CorruptRecordError",
    "FeatureSpecError",
    "InputContext",
    "InputOptions",
    "InputStateError",
    "Manifest",
    "MixtureInput",
    "PackSequences",
    "PadSequences",
    "TFDSInput",
    "TFRecordInput",
    "TextCorpus",
    "explain_data_loss",
    "bigram_bits_per_byte",
    "bucket_by_length",
    "explain_parse_error",
    "mix_datasets",
    "pack_sequences",
    "pad_sequences",
    "pad_to_batch",
    "feature_spec_for",
    "parse_feature_spec",
    "read_manifest",
    "source_counts",
    "stateless_augment",
    "stdlib_files",
    "write_text_corpus",
    "write_tfrecords",
]
