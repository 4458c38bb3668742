"""Model definitions of the zoo in plain ``torch.nn`` (no torchvision, no transformers, no weights).

Each class mirrors the code structure and parameter names of its source so that ``named_parameters()``
gives the same names, shapes and order:

* :func:`resnet20_cifar`: ResNet-20 for CIFAR-10 (He et al. 2016, option-A shortcuts: a stride-2 average
  pool and zero channels, no parameters) as the gTop-k authors train it (``hclhkbu/gtopkssgd``,
  ``models/resnet.py``, ``CifarResNet``): 269,722 parameters. Input (B, 3, 32, 32) float.
* :func:`vgg16_cifar`: VGG-16 for CIFAR-10 as in the gTop-k code (``models/vgg.py``, the
  ``kuangliu/pytorch-cifar`` definition): the 13 conv3x3 (with bias) + BatchNorm + ReLU layers of VGG-16,
  5 max pools, a 1x1 average pool and ``fc = Linear(512, 10)``: 14,728,266 parameters. Input (B, 3, 32, 32).
* :func:`resnet50`, :func:`vgg16`, :func:`alexnet`: as ``torchvision.models`` defines them (ResNet-50 v1.5
  with the stride on the 3x3 conv: 25,557,032; VGG-16 without BatchNorm: 138,357,544; AlexNet: 61,100,840).
  Input (B, 3, 224, 224) float.
* :func:`bert_base`: HuggingFace ``BertModel(BertConfig())`` with the pooler, eager attention: 109,482,240.
  Input (B, T) int64 token ids (T <= 512; no padding mask, token types 0).
* :func:`gpt2_small`: HuggingFace ``GPT2Model(GPT2Config())`` (no LM head; HF ties it to ``wte``), eager
  attention: 124,439,808. Input (B, T) int64 token ids (T <= 1024).
* :func:`lstm_ptb`: the gTop-k papers' LSTM-PTB language model (``models/lstm.py``, ``lstm``): embedding
  10000 x 1500, a 2-layer ``nn.LSTM`` with 1500 hidden units, untied decoder ``sm_fc = Linear(1500, 10000)``:
  66,034,000 parameters. Input (B, 35) int64 token ids (batch first here; the original is sequence first,
  which changes neither parameters nor FLOPs; the initial hidden state is zero).

Parameters keep PyTorch's default initialisation: the zoo uses shapes and costs only. Build on the meta
device (``with torch.device("meta"): resnet50()``) to get shapes without memory. Requires torch.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["resnet20_cifar", "vgg16_cifar", "resnet50", "vgg16", "alexnet", "bert_base", "gpt2_small",
           "lstm_ptb", "BUILDERS"]


# --------------------------------------------------------------------------------------------------
# ResNet-20 for CIFAR-10 (gTop-k code: CifarResNet with DownsampleA)
# --------------------------------------------------------------------------------------------------

class DownsampleA(nn.Module):
    """Option-A shortcut: average pool with stride 2 (kernel 1), then the channels doubled with zeros."""

    def __init__(self, n_in: int, n_out: int, stride: int):
        super().__init__()
        assert stride == 2 and n_out == 2 * n_in
        self.avg = nn.AvgPool2d(kernel_size=1, stride=stride)

    def forward(self, x):
        x = self.avg(x)
        return torch.cat((x, x.mul(0)), 1)


class ResNetBasicblock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus shortcut, then ReLU (no conv biases)."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv_a = nn.Conv2d(inplanes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn_a = nn.BatchNorm2d(planes)
        self.conv_b = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn_b = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        residual = x
        out = F.relu(self.bn_a(self.conv_a(x)), inplace=True)
        out = self.bn_b(self.conv_b(out))
        if self.downsample is not None:
            residual = self.downsample(x)
        return F.relu(residual + out, inplace=True)


class CifarResNet(nn.Module):
    """ResNet-(6n+2) for 32x32 inputs: 16-32-64 channels in three stages of n basic blocks."""

    def __init__(self, depth: int = 20, num_classes: int = 10):
        super().__init__()
        assert (depth - 2) % 6 == 0
        n = (depth - 2) // 6
        self.conv_1_3x3 = nn.Conv2d(3, 16, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn_1 = nn.BatchNorm2d(16)
        self.inplanes = 16
        self.stage_1 = self._make_layer(16, n, 1)
        self.stage_2 = self._make_layer(32, n, 2)
        self.stage_3 = self._make_layer(64, n, 2)
        self.avgpool = nn.AvgPool2d(8)
        self.classifier = nn.Linear(64, num_classes)

    def _make_layer(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = DownsampleA(self.inplanes, planes, stride)
        layers = [ResNetBasicblock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [ResNetBasicblock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = F.relu(self.bn_1(self.conv_1_3x3(x)), inplace=True)
        x = self.stage_3(self.stage_2(self.stage_1(x)))
        x = self.avgpool(x)
        return self.classifier(x.view(x.size(0), -1))


def resnet20_cifar() -> nn.Module:
    """ResNet-20 for CIFAR-10 as in the gTop-k code: 269,722 parameters; input (B, 3, 32, 32) float."""
    return CifarResNet(20, 10)


# --------------------------------------------------------------------------------------------------
# VGG-16 for CIFAR-10 (gTop-k code / kuangliu pytorch-cifar)
# --------------------------------------------------------------------------------------------------

_VGG16_CFG = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


class VGGCifar(nn.Module):
    """VGG for 32x32 inputs: conv3x3+BN+ReLU stack (``features``), then ``fc = Linear(512, classes)``."""

    def __init__(self, cfg=tuple(_VGG16_CFG), num_classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = []
        c = 3
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                layers += [nn.Conv2d(c, v, kernel_size=3, padding=1), nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
                c = v
        layers.append(nn.AvgPool2d(kernel_size=1, stride=1))
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        out = self.features(x)
        return self.fc(out.view(out.size(0), -1))


def vgg16_cifar() -> nn.Module:
    """VGG-16 (BatchNorm) for CIFAR-10 as in the gTop-k code: 14,728,266 parameters; input (B, 3, 32, 32)."""
    return VGGCifar()


# --------------------------------------------------------------------------------------------------
# torchvision: ResNet-50, VGG-16, AlexNet
# --------------------------------------------------------------------------------------------------

def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False)


class Bottleneck(nn.Module):
    """torchvision's Bottleneck (v1.5: stride on the 3x3 conv): 1x1, 3x3, 1x1 convs, each with BatchNorm."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        width = planes
        self.conv1 = _conv1x1(inplanes, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv1x1(width, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ResNet with Bottleneck blocks (``layers`` blocks per stage)."""

    def __init__(self, layers=(3, 4, 6, 3), num_classes: int = 1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(64, layers[0])
        self.layer2 = self._make_layer(128, layers[1], stride=2)
        self.layer3 = self._make_layer(256, layers[2], stride=2)
        self.layer4 = self._make_layer(512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(_conv1x1(self.inplanes, planes * Bottleneck.expansion, stride),
                                       nn.BatchNorm2d(planes * Bottleneck.expansion))
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def resnet50() -> nn.Module:
    """torchvision ``resnet50()`` (no weights): 25,557,032 parameters; input (B, 3, 224, 224) float."""
    return ResNet((3, 4, 6, 3))


class VGG(nn.Module):
    """torchvision's VGG: ``features``, ``avgpool`` (adaptive 7x7), ``classifier`` (3 Linear layers)."""

    def __init__(self, features: nn.Sequential, num_classes: int = 1000, dropout: float = 0.5):
        super().__init__()
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096), nn.ReLU(True), nn.Dropout(p=dropout),
            nn.Linear(4096, 4096), nn.ReLU(True), nn.Dropout(p=dropout),
            nn.Linear(4096, num_classes))

    def forward(self, x):
        x = torch.flatten(self.avgpool(self.features(x)), 1)
        return self.classifier(x)


def _vgg_features(cfg) -> nn.Sequential:
    layers: list[nn.Module] = []
    c = 3
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            layers += [nn.Conv2d(c, v, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
            c = v
    return nn.Sequential(*layers)


def vgg16() -> nn.Module:
    """torchvision ``vgg16()`` (configuration D, no BatchNorm, no weights): 138,357,544 parameters;
    input (B, 3, 224, 224) float."""
    return VGG(_vgg_features(_VGG16_CFG))


class AlexNet(nn.Module):
    """torchvision's AlexNet (the one-GPU variant of Krizhevsky 2014)."""

    def __init__(self, num_classes: int = 1000, dropout: float = 0.5):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=11, stride=4, padding=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(64, 192, kernel_size=5, padding=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2))
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout), nn.Linear(256 * 6 * 6, 4096), nn.ReLU(inplace=True),
            nn.Dropout(p=dropout), nn.Linear(4096, 4096), nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes))

    def forward(self, x):
        x = torch.flatten(self.avgpool(self.features(x)), 1)
        return self.classifier(x)


def alexnet() -> nn.Module:
    """torchvision ``alexnet()`` (no weights): 61,100,840 parameters; input (B, 3, 224, 224) float."""
    return AlexNet()


# --------------------------------------------------------------------------------------------------
# BERT-base (HuggingFace BertModel, BertConfig() defaults)
# --------------------------------------------------------------------------------------------------

class BertEmbeddings(nn.Module):
    """Word + token-type + absolute position embeddings, LayerNorm, dropout (HF order of execution)."""

    def __init__(self, vocab=30522, hidden=768, max_pos=512, type_vocab=2, eps=1e-12, p=0.1):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden, padding_idx=0)
        self.position_embeddings = nn.Embedding(max_pos, hidden)
        self.token_type_embeddings = nn.Embedding(type_vocab, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)
        self.dropout = nn.Dropout(p)
        self.register_buffer("position_ids", torch.arange(max_pos).expand((1, -1)), persistent=False)
        self.register_buffer("token_type_ids", torch.zeros((1, max_pos), dtype=torch.long), persistent=False)

    def forward(self, input_ids):
        t = input_ids.shape[1]
        embeddings = self.word_embeddings(input_ids)
        token_type_ids = self.token_type_ids[:, :t].expand(input_ids.shape[0], t)
        embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        embeddings = embeddings + self.position_embeddings(self.position_ids[:, :t])
        return self.dropout(self.LayerNorm(embeddings))


class BertSelfAttention(nn.Module):
    """Multi-head self-attention, eager: softmax(Q K^T / sqrt(d)) V with 12 heads of 64 (no mask)."""

    def __init__(self, hidden=768, heads=12, p=0.1):
        super().__init__()
        self.num_attention_heads = heads
        self.attention_head_size = hidden // heads
        self.all_head_size = hidden
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(p)

    def _heads(self, x):
        b, t, _ = x.shape
        return x.view(b, t, self.num_attention_heads, self.attention_head_size).transpose(1, 2)

    def forward(self, hidden_states):
        q = self._heads(self.query(hidden_states))
        k = self._heads(self.key(hidden_states))
        v = self._heads(self.value(hidden_states))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
        probs = self.dropout(F.softmax(scores, dim=-1))
        ctx = torch.matmul(probs, v).transpose(1, 2).contiguous()
        return ctx.view(ctx.shape[0], ctx.shape[1], self.all_head_size)


class BertAttention(nn.Module):
    """``self`` (BertSelfAttention) then ``output`` (BertSelfOutput), as HF names them."""

    def __init__(self):
        super().__init__()
        self.self = BertSelfAttention()
        self.output = BertSelfOutput()

    def forward(self, hidden_states):
        return self.output(self.self(hidden_states), hidden_states)


class BertIntermediate(nn.Module):
    """dense 768 -> 3072 and GELU (erf)."""

    def __init__(self, hidden=768, inter=3072):
        super().__init__()
        self.dense = nn.Linear(hidden, inter)
        self.intermediate_act_fn = nn.GELU()

    def forward(self, x):
        return self.intermediate_act_fn(self.dense(x))


class BertOutput(nn.Module):
    """dense 3072 -> 768, dropout, LayerNorm(x + input)."""

    def __init__(self, hidden=768, inter=3072, eps=1e-12, p=0.1):
        super().__init__()
        self.dense = nn.Linear(inter, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)
        self.dropout = nn.Dropout(p)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + input_tensor)


class BertSelfOutput(BertOutput):
    """dense 768 -> 768, dropout, LayerNorm(x + input): BertOutput at hidden size (HF's own class and names)."""

    def __init__(self, hidden=768, eps=1e-12, p=0.1):
        super().__init__(hidden, hidden, eps, p)


class BertLayer(nn.Module):
    """One encoder layer: attention, intermediate, output."""

    def __init__(self):
        super().__init__()
        self.attention = BertAttention()
        self.intermediate = BertIntermediate()
        self.output = BertOutput()

    def forward(self, x):
        a = self.attention(x)
        return self.output(self.intermediate(a), a)


class BertEncoder(nn.Module):
    """``layer``: a ModuleList of 12 BertLayer."""

    def __init__(self, n=12):
        super().__init__()
        self.layer = nn.ModuleList([BertLayer() for _ in range(n)])

    def forward(self, x):
        for layer in self.layer:
            x = layer(x)
        return x


class BertPooler(nn.Module):
    """tanh(dense(first token))."""

    def __init__(self, hidden=768):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.activation = nn.Tanh()

    def forward(self, x):
        return self.activation(self.dense(x[:, 0]))


class BertModel(nn.Module):
    """HF BertModel (BertConfig() defaults) with pooler. forward(input_ids (B, T) int64) returns
    (last hidden state (B, T, 768), pooled output (B, 768))."""

    def __init__(self):
        super().__init__()
        self.embeddings = BertEmbeddings()
        self.encoder = BertEncoder()
        self.pooler = BertPooler()

    def forward(self, input_ids):
        h = self.encoder(self.embeddings(input_ids))
        return h, self.pooler(h)


def bert_base() -> nn.Module:
    """HF ``BertModel(BertConfig())``: 109,482,240 parameters; input (B, T <= 512) int64 token ids."""
    return BertModel()


# --------------------------------------------------------------------------------------------------
# GPT-2 small (HuggingFace GPT2Model, GPT2Config() defaults)
# --------------------------------------------------------------------------------------------------

class Conv1D(nn.Module):
    """HF's Conv1D: a linear layer with the weight stored transposed, (nx, nf); y = x @ W + b."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class GPT2Attention(nn.Module):
    """Causal self-attention, eager: ``c_attn`` (768 -> 3*768), 12 heads, ``c_proj``."""

    def __init__(self, n_embd=768, n_head=12, n_pos=1024, p=0.1):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones((n_pos, n_pos), dtype=torch.bool)).view(1, 1, n_pos, n_pos),
                             persistent=False)
        self.embed_dim = n_embd
        self.num_heads = n_head
        self.head_dim = n_embd // n_head
        self.c_attn = Conv1D(3 * n_embd, n_embd)
        self.c_proj = Conv1D(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(p)
        self.resid_dropout = nn.Dropout(p)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).split(self.embed_dim, dim=2)
        q, k, v = (z.view(b, t, self.num_heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        w = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        w = torch.where(self.bias[:, :, :t, :t], w, torch.finfo(w.dtype).min)
        w = self.attn_dropout(F.softmax(w, dim=-1))
        a = torch.matmul(w, v).transpose(1, 2).contiguous().view(b, t, self.embed_dim)
        return self.resid_dropout(self.c_proj(a))


class GPT2MLP(nn.Module):
    """``c_fc`` (768 -> 3072), GELU (tanh approximation, HF ``gelu_new``), ``c_proj`` (3072 -> 768), dropout."""

    def __init__(self, n_embd=768, inner=3072, p=0.1):
        super().__init__()
        self.c_fc = Conv1D(inner, n_embd)
        self.c_proj = Conv1D(n_embd, inner)
        self.act = nn.GELU(approximate="tanh")
        self.dropout = nn.Dropout(p)

    def forward(self, x):
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class GPT2Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, n_embd=768, eps=1e-5):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, eps=eps)
        self.attn = GPT2Attention()
        self.ln_2 = nn.LayerNorm(n_embd, eps=eps)
        self.mlp = GPT2MLP()

    def forward(self, x):
        x = self.attn(self.ln_1(x)) + x
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    """HF GPT2Model (GPT2Config() defaults). forward(input_ids (B, T) int64) -> last hidden state (B, T, 768)."""

    def __init__(self, vocab=50257, n_pos=1024, n_embd=768, n_layer=12, p=0.1, eps=1e-5):
        super().__init__()
        self.embed_dim = n_embd
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(n_pos, n_embd)
        self.drop = nn.Dropout(p)
        self.h = nn.ModuleList([GPT2Block() for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd, eps=eps)

    def forward(self, input_ids):
        t = input_ids.shape[1]
        position_ids = torch.arange(t, device=input_ids.device).unsqueeze(0)
        x = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


def gpt2_small() -> nn.Module:
    """HF ``GPT2Model(GPT2Config())``: 124,439,808 parameters; input (B, T <= 1024) int64 token ids."""
    return GPT2Model()


# --------------------------------------------------------------------------------------------------
# LSTM-PTB (gTop-k code: models/lstm.py)
# --------------------------------------------------------------------------------------------------

class PTBLSTM(nn.Module):
    """Embedding, dropout, 2-layer LSTM, dropout, decoder ``sm_fc``; returns logits (B, T, vocab)."""

    def __init__(self, vocab_size=10000, embedding_dim=1500, num_layers=2, dp_keep_prob=0.35):
        super().__init__()
        self.embedding_dim = embedding_dim
        self.vocab_size = vocab_size
        self.dropout = nn.Dropout(1 - dp_keep_prob)
        self.word_embeddings = nn.Embedding(vocab_size, embedding_dim)
        self.lstm = nn.LSTM(input_size=embedding_dim, hidden_size=embedding_dim, num_layers=num_layers,
                            dropout=1 - dp_keep_prob, batch_first=True)
        self.sm_fc = nn.Linear(embedding_dim, vocab_size)

    def forward(self, inputs):
        embeds = self.dropout(self.word_embeddings(inputs))
        out, _ = self.lstm(embeds)
        return self.sm_fc(self.dropout(out))


def lstm_ptb() -> nn.Module:
    """The gTop-k papers' LSTM-PTB: 66,034,000 parameters; input (B, 35) int64 token ids < 10000."""
    return PTBLSTM()


BUILDERS = {
    "resnet20-cifar": resnet20_cifar,
    "vgg16-cifar": vgg16_cifar,
    "vgg16": vgg16,
    "alexnet": alexnet,
    "resnet50": resnet50,
    "bert-base": bert_base,
    "gpt2-small": gpt2_small,
    "lstm-ptb": lstm_ptb,
}
"""Zoo name -> constructor of the torch module (no arguments)."""
