"""keras.applications models at test size: each made by Keras's own builder of its family, with every kind of
block of the named model and fewer repeats.

Why: the tests train these models data parallel in worker processes, plain and with each pass, and a worker's
time goes to building the model (one XLA compile per variable shape for its initializers) and compiling its
training step, both about linear in the number of blocks. The full models repeat the same blocks: ResNet50 has
16 bottleneck blocks of 2 kinds, EfficientNetB0 16 MBConv blocks, MobileNetV3Small 11 inverted residual
blocks, ConvNeXtTiny 18 ConvNeXt blocks of one kind. Each model here keeps every kind of block its full model
has (the first block of a stage, which changes width or resolution, and a repeated block with its residual
add), every kind of layer (stems, preprocessing, squeeze-and-excitation, depthwise and strided convolutions,
BatchNorm or LayerNorm, the head) and so every kind of weight the passes see, through the same Keras code
(`keras.src.applications`, whose builders Keras does not export), at a quarter to a third of the blocks.

`build(name, input_shape, classes)` makes one by its name in BUILDERS (each builder takes the keyword arguments
of the model's input and head), or a full keras.applications model by its own name. Import this after choosing
Keras's backend.
"""
from __future__ import annotations

import copy
import sys

def resnet(head):
    """ResNet50's stem, its four stages of bottleneck blocks at its widths (64 to 512 filters, each stage's first
    block with a projection shortcut) and its head; the first stage also has one identity block, where
    ResNet50 has 3, 4, 6 and 3 blocks a stage."""
    from keras.src.applications import resnet as family

    def stack_fn(x):
        x = family.stack_residual_blocks_v1(x, 64, 2, stride1=1, name="conv2")
        x = family.stack_residual_blocks_v1(x, 128, 1, name="conv3")
        x = family.stack_residual_blocks_v1(x, 256, 1, name="conv4")
        return family.stack_residual_blocks_v1(x, 512, 1, name="conv5")

    return family.ResNet(stack_fn, preact=False, use_bias=True, name="resnet", **head)


def efficientnet(head):
    """EfficientNetB0 (its width, its preprocessing, stem, top and head) with its first three stages of MBConv
    blocks: the one without expansion, then 3x3 and 5x5 depthwise ones with expansion 6 and stride 2, the 3x3
    stage twice (the second block with B0's stochastic-depth Dropout and residual add). Every block has B0's
    squeeze-and-excitation."""
    from keras.src.applications import efficientnet as family

    blocks = copy.deepcopy(family.DEFAULT_BLOCKS_ARGS[:3])
    for args, repeats in zip(blocks, (1, 2, 1)):
        args["repeats"] = repeats
    return family.EfficientNet(1.0, 1.0, 224, 0.2, blocks_args=blocks, name="efficientnet", **head)


def mobilenetv3(head):
    """MobileNetV3Small's preprocessing, stem, last convolutions and head with 4 of its 11 inverted residual
    blocks: its first (squeeze-and-excitation, ReLU, stride 2), its second and third (no SE; the third a residual
    one) and its fourth (5x5, SE, hard-swish, stride 2)."""
    from keras.src.applications import mobilenet_v3 as family

    def stack_fn(x, kernel, activation, se_ratio):
        x = family._inverted_res_block(x, 1, family._depth(16), 3, 2, se_ratio, family.relu, 0)
        x = family._inverted_res_block(x, 72.0 / 16, family._depth(24), 3, 2, None, family.relu, 1)
        x = family._inverted_res_block(x, 88.0 / 24, family._depth(24), 3, 1, None, family.relu, 2)
        return family._inverted_res_block(x, 4, family._depth(40), kernel, 2, se_ratio, activation, 3)

    return family.MobileNetV3(stack_fn, 1024, alpha=1.0, model_type="small", name="mobilenetv3", **head)


def convnext(head):
    """ConvNeXtTiny's preprocessing, stem, downsampling layers, widths (96 to 768) and head with one ConvNeXt
    block a stage, where it has 3, 3, 9 and 3."""
    from keras.src.applications import convnext as family

    config = family.MODEL_CONFIGS["tiny"]
    return family.ConvNeXt(depths=[1, 1, 1, 1], projection_dims=config["projection_dims"], drop_path_rate=0.0,
                           layer_scale_init_value=1e-6, default_size=config["default_size"], name="convnext", **head)


# The test-size models by name: ResNet50's, EfficientNetB0's, MobileNetV3Small's and ConvNeXtTiny's blocks.
BUILDERS = {"resnet": resnet, "efficientnet": efficientnet, "mobilenetv3": mobilenetv3, "convnext": convnext}


def build(name: str, input_shape, classes: int, classifier_activation="softmax"):
    """The test-size model `name` (a key of BUILDERS), or the full keras.applications model `name` (as the benchmarks
    use), for `input_shape` images and `classes` classes, its head's activation `classifier_activation` (None:
    logits)."""
    head = dict(weights=None, input_shape=tuple(input_shape), classes=classes,
                classifier_activation=classifier_activation)
    if name in BUILDERS:
        return BUILDERS[name](head)
    import keras

    return getattr(keras.applications, name)(**head)


def set_random_seed(seed: int) -> None:
    """`keras.utils.set_random_seed(seed)` without importing TensorFlow, for Keras on JAX.

    Keras seeds TensorFlow too wherever it is installed (for tf.data pipelines), and importing it takes 5 to 20 s
    of a worker's start. Blocked for the call, the import fails, Keras records TensorFlow as unavailable and seeds
    Python, NumPy and its own generators. The block is lifted afterwards, so that nothing else that the models run
    sees it: Keras's preprocessing layers (Rescaling, Normalization) ask for TensorFlow only once it is imported.
    """
    import keras

    blocked = "tensorflow" not in sys.modules
    if blocked:
        sys.modules["tensorflow"] = None  # an import of it fails
    try:
        keras.utils.set_random_seed(seed)
    finally:
        if blocked:
            del sys.modules["tensorflow"]
