"""Input pipelines: sharded TFRecord reading and writing."""
