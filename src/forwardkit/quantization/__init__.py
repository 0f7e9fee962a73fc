"""Quantized weights: block formats (``formats``), the quantized linear method the linear layers
hold (``linear_method``) and its registered op (``ops``)."""
