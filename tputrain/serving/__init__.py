"""From a checkpoint to what serving systems load.

* `export`: the SavedModel writer (`export_checkpoint`) and the `Export` action;
* `keras_saving`: `.keras` files, LoRA merged or kept, int8 quantization
  (`export_for_serving`).
"""
