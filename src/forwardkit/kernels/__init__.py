"""Hand-written kernels and their run-time state, below the model layers.

``kernels.cpu``: the native few-row linear kernel and the native paged decode attention
(built with the system C compiler), the
``forwardkit::linear`` op with the router that sends each weight's products down the fastest
CPU path, and transparent huge pages for CPU weights. Layers decide whether to call the op;
everything about how it runs lives here.
"""
