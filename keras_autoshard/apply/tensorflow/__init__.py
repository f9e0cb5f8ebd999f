"""TensorFlow backend: planning (in a JAX subprocess) and data parallelism
through `tf.distribute.MirroredStrategy`. Tensor parallelism is refused with
`TensorFlowModelParallelError` (see docs/tensorflow.md for why).

Nothing outside `backends.tensorflow` imports TensorFlow.
"""
