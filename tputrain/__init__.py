"""tputrain: a TPU-first training library for TensorFlow 2 / Keras 3."""
