"""From a checkpoint to what serving systems load.

* `export`: the SavedModel writer (`export_checkpoint`; the `Export` action that
  calls it at the end of training is `tputrain.actions.export`);
* `keras_saving`: `.keras` files, LoRA merged or kept, int8 quantization
  (`export_for_serving`).
"""
