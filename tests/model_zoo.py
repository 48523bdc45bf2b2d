"""Models the conversion tests run over, with explicit exclusions and reasons.

Torchvision: every classification model from ``torchvision.models.list_models``
except the ones excluded below. timm: one or two small members of each CNN
family. Inputs are small (64x64 unless a model needs more) to keep CI on 2
cores within minutes.
"""

from __future__ import annotations

import torchvision

TORCHVISION_EXCLUDED = {
    # Not CNNs: attention models, their Linear layers are not the paper's scope.
    **{m: "vision transformer (not a CNN)" for m in ("vit_b_16", "vit_b_32", "vit_l_16", "vit_l_32", "vit_h_14")},
    **{
        m: "swin transformer (not a CNN)" for m in ("swin_t", "swin_s", "swin_b", "swin_v2_t", "swin_v2_s", "swin_v2_b")
    },
    "maxvit_t": "attention hybrid (not a CNN)",
    # >= 60M weights in fully connected layers: minutes of CPU per test on 2 cores.
    **{
        m: "120M+ weights, most in fully connected layers: too slow for CPU CI (VGG covered by timm vgg11)"
        for m in ("vgg11", "vgg11_bn", "vgg13", "vgg13_bn", "vgg16", "vgg16_bn", "vgg19", "vgg19_bn")
    },
    "alexnet": "61M weights, 58M in fully connected layers: too slow for CPU CI",
    # Large members of families whose small members are tested.
    **{
        m: "large member of a tested family (slow on 2 CPU cores)"
        for m in (
            "resnet50",
            "resnet101",
            "resnet152",
            "resnext50_32x4d",
            "resnext101_32x8d",
            "resnext101_64x4d",
            "wide_resnet50_2",
            "wide_resnet101_2",
            "densenet161",
            "densenet169",
            "densenet201",
            "efficientnet_b1",
            "efficientnet_b2",
            "efficientnet_b3",
            "efficientnet_b4",
            "efficientnet_b5",
            "efficientnet_b6",
            "efficientnet_b7",
            "efficientnet_v2_m",
            "efficientnet_v2_l",
            "regnet_x_1_6gf",
            "regnet_x_3_2gf",
            "regnet_x_8gf",
            "regnet_x_16gf",
            "regnet_x_32gf",
            "regnet_y_1_6gf",
            "regnet_y_3_2gf",
            "regnet_y_8gf",
            "regnet_y_16gf",
            "regnet_y_32gf",
            "regnet_y_128gf",
            "convnext_small",
            "convnext_base",
            "convnext_large",
            "mnasnet1_0",
            "mnasnet1_3",
            "shufflenet_v2_x1_5",
            "shufflenet_v2_x2_0",
            "mobilenet_v3_large",
            "resnet34",
            "efficientnet_v2_s",
        )
    },
}

TORCHVISION_KWARGS = {
    "inception_v3": {"aux_logits": False, "init_weights": False},
    "googlenet": {"aux_logits": False, "init_weights": False},
}

INPUT_SIZE = {"inception_v3": 80, "timm:inception_v3": 80}

# ONNX export: timm's VGG head pools adaptively to 7x7, which the TorchScript exporter
# only lowers when the feature map size is a multiple of 7; at 64x64 export_onnx falls
# back to the torch.export-based exporter (tests/test_export_paths.py covers that path
# cheaply). 224 keeps this model on the TorchScript path, the default's.
EXPORT_INPUT_SIZE = {"timm:vgg11": 224}

TIMM_MODELS = [
    "resnet18",
    "resnet18d",
    "resnet26t",
    "seresnet18",
    "resnext26ts",
    "regnetx_002",
    "regnety_002",
    "mobilenetv2_050",
    "mobilenetv3_small_050",
    "efficientnet_b0",
    "tf_efficientnet_b0",
    "efficientnet_lite0",
    "mixnet_s",
    "ghostnet_050",
    "convnext_atto",
    "densenet121",
    "vgg11",
    "dla34",
    "hrnet_w18_small",
    "cspresnet50",
    "cspdarknet53",
    "rexnet_100",
    "dpn48b",
    "selecsls42b",
    "res2net50_14w_8s",
    "nf_resnet26",
    "resnetv2_50x1_bit",
    "lcnet_050",
    "repvgg_a0",
    "fbnetc_100",
    "tinynet_e",
    "mobileone_s0",
    "hgnetv2_b0",
    # Attention hybrids and more re-parameterisable / split-attention blocks.
    # (skresnet18: selective-kernel attention is covered by resnest14d's split attention; 20 s on 2 cores.)
    "mobilevit_xxs",
    "fastvit_t8",
    "edgenext_xx_small",
    "resnest14d",
    "repghostnet_050",
]


TIMM_KWARGS = {
    # VGG's ConvMlp (a leaf module hiding two convs) keeps its structure; a 64-channel
    # hidden width instead of 4096 keeps the 7x7 fc1 at 1.6M weights instead of 103M.
    "vgg11": {"mlp_ratio": 1 / 64},
}


def torchvision_models() -> list[str]:
    names = torchvision.models.list_models(module=torchvision.models)
    return [f"torchvision:{n}" for n in names if n not in TORCHVISION_EXCLUDED]


def build(spec: str, num_classes: int = 10):
    src, name = spec.split(":", 1)
    if src == "torchvision":
        return torchvision.models.get_model(
            name, weights=None, num_classes=num_classes, **TORCHVISION_KWARGS.get(name, {})
        )
    import timm

    return timm.create_model(name, num_classes=num_classes, pretrained=False, **TIMM_KWARGS.get(name, {}))


def input_size(spec: str) -> int:
    return INPUT_SIZE.get(spec, INPUT_SIZE.get(spec.split(":", 1)[1], 64))


def export_input_size(spec: str) -> int:
    return EXPORT_INPUT_SIZE.get(spec, input_size(spec))
