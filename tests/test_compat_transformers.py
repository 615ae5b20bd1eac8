"""transformers with attn_implementation="flash_attention_2" on the flash-attn compatibility package, end to end, on
a small random Llama with grouped-query attention: (a) a padded batch with an attention mask, which transformers
unpads for flash_attn_varlen_func; (b) sequences packed in one row with restarting position_ids (TRL's padding-free
training), also with the flash kwargs of transformers' DataCollatorWithFlattening; (c) generation with a cache.

The 2x rule at the model's level: the reference is the same model run with "sdpa" in float64, the peer that run in
the precision under test (weights in the dtype for the logits; fp32 weights under autocast for training, as in
mixed-precision fine-tuning), and the error of the flash_attention_2 run must be at most twice the peer's (+1e-5),
for the logits and, over three SGD steps, for every step's logits and gradients. The errors are norms over all the
elements: in a model the errors of every layer mix, and with two equally accurate attentions (fp32, ten random
models) the largest single error differed by up to 2x between the runs, its norm by 25 %."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.gpu

IMPLEMENTATION = "flash_attention_2"
DEVICE = "cuda"
# Head dim 32; an initializer range of 0.06 makes the scores' spread about 1 (peaked rows, not uniform ones).
CONFIG = dict(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.06,
    tie_word_embeddings=False,
)
DTYPES = [torch.float16, torch.bfloat16]
TRAIN_STEPS, LEARNING_RATE = 3, 3e-4  # summed losses: gradients up to about 20


@pytest.fixture(scope="module")
def llama(flash_attn_compat, tmp_path_factory):
    """A saved random Llama (fp32), loadable with any attention implementation. transformers finds flash-attn
    through the installed distribution's metadata, so the package must be installed, not only importable."""
    if "flash-attn" not in importlib.metadata.packages_distributions().get("flash_attn", []):
        pytest.skip("transformers needs the flash-attn distribution installed: pip install ./compat")
    if importlib.metadata.version("flash-attn") != flash_attn_compat.__version__:
        pytest.skip(f"the installed flash-attn {importlib.metadata.version('flash-attn')} is not this package")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    return path


def load(path, implementation: str, dtype: torch.dtype):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=implementation, dtype=dtype)
    assert model.config._attn_implementation == implementation
    return model.to(DEVICE)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed next-token loss (a sum, not a mean, so that the gradients are of order 1 and the 2x rule's 1e-5
    is small beside their errors)."""
    logits = logits[:, :-1].flatten(0, 1)
    return F.cross_entropy(
        logits.to(torch.promote_types(logits.dtype, torch.float32)),
        labels[:, 1:].flatten(),
        ignore_index=-100,
        reduction="sum",
    )


def train(model, inputs: dict, labels: torch.Tensor, autocast_dtype: torch.dtype | None):
    """TRAIN_STEPS steps of SGD; each step's logits and gradients (all parameters, flattened, float64)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    model.train()
    steps = []
    for _ in range(TRAIN_STEPS):
        optimizer.zero_grad()
        with torch.autocast(DEVICE, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            logits = model(**inputs).logits
        causal_lm_loss(logits, labels).backward()
        grads = torch.cat([p.grad.double().flatten() for p in model.parameters()])
        steps.append((logits.detach(), grads))
        optimizer.step()
    return steps


def assert_norm_2x(name: str, ours: torch.Tensor, reference: torch.Tensor, peer: torch.Tensor) -> None:
    """||ours - reference|| <= 2 ||peer - reference|| + 1e-5, in float64; ours finite where the reference is."""
    assert ours.shape == reference.shape == peer.shape, f"{name}: shapes {ours.shape}, {reference.shape}, {peer.shape}"
    assert torch.equal(torch.isfinite(ours), torch.isfinite(reference)), f"{name}: non-finite values"
    err, peer_err = ((t.double() - reference.double()).norm().item() for t in (ours, peer))
    assert err <= 2 * peer_err + 1e-5, f"{name}: error norm {err:.3e} > 2 x sdpa's {peer_err:.3e} + 1e-5"


def check_model(path, dtype, inputs: dict, labels: torch.Tensor, valid: torch.Tensor, implementation=IMPLEMENTATION):
    """The logits of the model in dtype, and TRAIN_STEPS training steps in mixed precision, of `implementation`
    against sdpa, at the positions `valid` (bool, (batch, seqlen))."""
    ours = implementation
    runs = {}
    for name, implementation, model_dtype in (
        ("ours", ours, dtype),
        ("peer", "sdpa", dtype),
        ("reference", "sdpa", torch.float64),
    ):
        with torch.no_grad():
            runs[name] = load(path, implementation, model_dtype).eval()(**inputs).logits[valid]
    assert_norm_2x("logits", runs["ours"], runs["reference"], runs["peer"])

    trained = {
        name: train(load(path, implementation, model_dtype), inputs, labels, autocast_dtype)
        for name, implementation, model_dtype, autocast_dtype in (
            ("ours", ours, torch.float32, dtype),
            ("peer", "sdpa", torch.float32, dtype),
            ("reference", "sdpa", torch.float64, None),
        )
    }
    for step, (ours, peer, reference) in enumerate(zip(trained["ours"], trained["peer"], trained["reference"])):
        assert_norm_2x(f"step {step} logits", ours[0][valid], reference[0][valid], peer[0][valid])
        assert_norm_2x(f"step {step} gradients", ours[1], reference[1], peer[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_padded_batch(dtype, llama, require_support):
    """(a) Right-padded sequences of 48, 31 and 9 tokens with their attention mask."""
    require_support(dtype)
    lengths, seqlen = [48, 31, 9], 48
    input_ids = torch.randint(3, CONFIG["vocab_size"], (len(lengths), seqlen), device=DEVICE)
    mask = (torch.arange(seqlen, device=DEVICE) < torch.tensor(lengths, device=DEVICE)[:, None]).long()
    labels = input_ids.masked_fill(mask == 0, -100)
    inputs = dict(input_ids=input_ids, attention_mask=mask, use_cache=False)
    check_model(llama, dtype, inputs, labels, mask.bool())


@pytest.mark.parametrize("with_flash_kwargs", [False, True], ids=["position_ids", "flash_kwargs"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_packed_sequences(dtype, with_flash_kwargs, llama, require_support):
    """(b) Sequences of 37, 64, 1 and 26 tokens packed in one row, position_ids restarting at each (TRL's
    padding-free batches), the first token of each labelled -100; with_flash_kwargs: also cu_seq_lens_q/k and
    max_length_q/k, as transformers' DataCollatorWithFlattening(return_flash_attn_kwargs=True) gives them. The
    reference run packed equals the sequences run one by one."""
    require_support(dtype)
    lengths = [37, 64, 1, 26]
    input_ids = torch.randint(3, CONFIG["vocab_size"], (1, sum(lengths)), device=DEVICE)
    position_ids = torch.cat([torch.arange(n, device=DEVICE) for n in lengths]).unsqueeze(0)
    starts = torch.tensor([0, *lengths[:-1]], device=DEVICE).cumsum(0)
    labels = input_ids.clone()
    labels[0, starts] = -100
    # No cache: with one, transformers does not look for packed sequences in sdpa's mask.
    inputs = dict(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    if with_flash_kwargs:
        cu_seqlens = torch.tensor([0, *lengths], device=DEVICE).cumsum(0).to(torch.int32)
        inputs.update(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max(lengths))
        inputs.update(max_length_k=max(lengths))

    reference = load(llama, "sdpa", torch.float64).eval()
    with torch.no_grad():
        packed = reference(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits[0]
        sequences = input_ids.split(lengths, dim=1)
        one_by_one = torch.cat([reference(input_ids=ids, use_cache=False).logits[0] for ids in sequences])
    # The reference separates the sequences: the two float64 runs agree to about 4e-7 (not to rounding, on an H100
    # with transformers 5.17), where a leak across sequences would differ by orders of magnitude more.
    torch.testing.assert_close(packed, one_by_one, rtol=0, atol=1e-5)

    check_model(llama, dtype, inputs, labels, torch.ones_like(input_ids, dtype=torch.bool))


class ForceTokens(transformers.LogitsProcessor):
    """Makes generate pick the given tokens (batch, new_tokens), so that every model decodes the same sequence;
    output_logits still returns the model's own logits."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens, self.step = tokens, 0

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, float("-inf"))
        forced.scatter_(1, self.tokens[:, self.step : self.step + 1], 0.0)
        self.step += 1
        return forced


@pytest.mark.parametrize("padded", [False, True], ids=["equal_lengths", "left_padded"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_generation_with_cache(dtype, padded, llama, require_support):
    """(c) Greedy generation of 12 tokens from two prompts (13 and 6 tokens, left-padded, or both 13), cache on:
    the logits of every step, against sdpa decoding the same tokens (float64 and dtype)."""
    require_support(dtype)
    lengths, seqlen = ([13, 6] if padded else [13, 13]), 13
    input_ids = torch.randint(3, CONFIG["vocab_size"], (2, seqlen), device=DEVICE)
    mask = (torch.arange(seqlen, device=DEVICE) >= seqlen - torch.tensor(lengths, device=DEVICE)[:, None]).long()
    input_ids = input_ids.masked_fill(mask == 0, 0)
    options = dict(
        attention_mask=mask,
        max_new_tokens=12,
        do_sample=False,
        use_cache=True,
        min_new_tokens=12,  # a random model may pick the end-of-sequence token
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    ours = load(llama, IMPLEMENTATION, dtype).eval().generate(input_ids, **options)
    tokens = ours.sequences[:, seqlen:]
    assert tokens.shape == (2, 12)
    logits = {"ours": torch.stack(ours.logits, dim=1)}
    for name, model_dtype in (("peer", dtype), ("reference", torch.float64)):
        model = load(llama, "sdpa", model_dtype).eval()
        forced = transformers.LogitsProcessorList([ForceTokens(tokens)])
        run = model.generate(input_ids, logits_processor=forced, **options)
        assert torch.equal(run.sequences, ours.sequences)
        logits[name] = torch.stack(run.logits, dim=1)
    assert_norm_2x("logits", logits["ours"], logits["reference"], logits["peer"])
