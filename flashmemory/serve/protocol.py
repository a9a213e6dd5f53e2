"""OpenAI request bodies (pydantic, strict JSON types) and their validation into token ids and sampling parameters.

Strict: an integer field takes only a JSON integer (not true, not 3.0, not "3"), a boolean only true or false, a
string only a string; a number field takes integers and decimals. The raw body is checked first (serve/body.py).

Every list and dict field stops at its first bad item, and `prompt` is validated as the one form
its first element names: pydantic otherwise reports every bad item, once per accepted type (an
8 MiB array of floats as the prompt made millions of errors and took a minute). A bad `prompt` or
`tokens` element is named by its index.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    model_validator,
)

from flashmemory.engine.sampling import FLOAT32_MAX, FLOAT32_TINY, SEED_MODULUS, SamplingParams
from flashmemory.errors import PromptTooLongError
from flashmemory.serve.api_errors import APIError
from flashmemory.serve.body import json_kind, shown_json

MAX_STOP_STRINGS = 16
_TOOLS = "no tool or function calls are run or parsed"


def _absent(value: Any) -> bool:
    return value is None


def _off(value: Any) -> bool:
    """Unset, empty, zero or false: asks for nothing."""
    return not value


def _none_or(*inert: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or any(value == v for v in inert)


class Unsupported:
    """A field of the OpenAI API this server does not implement: the values that ask for nothing,
    and why any other value is refused."""

    def __init__(self, inert: Callable[[Any], bool], why: str, same_as: str | None = None) -> None:
        self.inert = inert  # true for the values that ask for nothing
        self.why = why
        self.same_as = same_as  # also inert when equal to this field of the request (best_of = n)

    def is_inert(self, request: BaseModel, name: str) -> bool:
        value = getattr(request, name)
        same = self.same_as is not None and value == getattr(request, self.same_as)
        return self.inert(value) or same


PROMPT_FORMS = ("a string, a list of strings, a list of token ids (integers) or a list of "
                "token-id lists")

T = TypeVar("T")
FailFastList = Annotated[list[T], Field(fail_fast=True)]  # validation stops at the first bad item
FailFastDict = Annotated[dict[str, T], Field(fail_fast=True)]


def _prompt_form(prompt: Any) -> str | None:
    """Which of OpenAI's four prompt forms `prompt` is, by its type and its first element's."""
    if type(prompt) is str:
        return "text"
    if type(prompt) is not list:
        return None
    if not prompt:
        return "token_ids"  # "the prompt is empty" later, with the other prompt checks
    return _FORM_OF_FIRST.get(type(prompt[0]))


_FORM_OF_FIRST = {int: "token_ids", str: "texts", list: "token_id_lists"}  # true's type is bool
Prompt = Annotated[
    Union[
        Annotated[str, Tag("text")],
        Annotated[FailFastList[int], Tag("token_ids")],
        Annotated[FailFastList[str], Tag("texts")],
        Annotated[FailFastList[FailFastList[int]], Tag("token_id_lists")],
    ],
    Discriminator(_prompt_form),
]


class _Request(BaseModel):
    # Unknown fields are ignored, as the OpenAI API and vLLM do; known but unsupported ones are
    # refused: a request that sets one of UNSUPPORTED to anything but an inert value (the default,
    # "none", an empty list) is a 400 naming the field (`check_supported`), never silently ignored.
    model_config = ConfigDict(extra="ignore", strict=True)
    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = {}

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # Clients send `"temperature": null` for "not set": take the default, as OpenAI does.
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    def check_supported(self, where: str = "") -> None:
        """Refuse the first unsupported field that is set: a 400 naming it (`where` + its name)."""
        for name, rule in self.UNSUPPORTED.items():
            if not rule.is_inert(self, name):
                raise APIError(400, f"{where}{name} is not supported by this server ({rule.why}); "
                               "remove it or leave it unset", param=f"{where}{name}",
                               code="unsupported_parameter")


class StreamOptions(_Request):
    include_usage: bool = False


class _GenerationRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    # The sampling bounds are SamplingParams' (engine/sampling.py says why): float32's range, 64-bit seeds.
    temperature: float = Field(1.0, ge=0, le=FLOAT32_MAX)  # OpenAI's default; below 1e-5 = greedy
    top_p: float = Field(1.0, ge=FLOAT32_TINY, le=1)
    top_k: int = Field(0, ge=-1)  # extension (as in vLLM): 0 or -1 = no limit
    stop: str | FailFastList[str] | None = None
    seed: int | None = Field(None, ge=0, lt=SEED_MODULUS)  # choice i of n uses (seed + i) mod 2**64
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension (as in vLLM): generate exactly max_tokens tokens
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: FailFastDict[float] | None = None
    UNSUPPORTED = {
        "presence_penalty": Unsupported(_off, "no penalties are applied"),
        "frequency_penalty": Unsupported(_off, "no penalties are applied"),
        "logit_bias": Unsupported(_off, "no logit bias is applied"),
    }

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def stop_strings(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}", param="stop")
        return tuple(stop)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_GenerationRequest):
    prompt: Prompt
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    UNSUPPORTED = {
        **_GenerationRequest.UNSUPPORTED,
        "echo": Unsupported(_off, "the prompt is not echoed"),
        # logprobs=0 still asks for the chosen tokens' log-probabilities
        "logprobs": Unsupported(_absent, "log-probabilities are not returned"),
        "suffix": Unsupported(_off, "there is no insertion mode"),
        "best_of": Unsupported(_absent, "every sampled choice is returned: use n", same_as="n"),
    }

    @model_validator(mode="wrap")
    @classmethod
    def _name_the_bad_prompt_element(cls, data: Any, handler: Any) -> Any:
        return _validated_naming_elements(handler, data, "prompt", f"prompt must be {PROMPT_FORMS}",
                                          forms_by_first=True)

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | FailFastList[dict[str, Any]] | None = None
    name: str | None = None
    # Tool-call history: without tool calls there is nothing a template could render from these.
    tool_calls: Any = None
    function_call: Any = None
    tool_call_id: Any = None
    UNSUPPORTED = {
        "tool_calls": Unsupported(_off, _TOOLS),
        "function_call": Unsupported(_absent, _TOOLS),
        "tool_call_id": Unsupported(_absent, _TOOLS),
    }

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        pieces = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"messages[{index}].content[{j}]: only text parts are supported "
                               f"(type 'text'), got type {part.get('type')!r}", param=f"messages.{index}.content")
            pieces.append(part["text"])
        return "".join(pieces)


class ChatCompletionRequest(_GenerationRequest):
    messages: FailFastList[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # extension (as in vLLM)
    # Refused unless inert (UNSUPPORTED); typed Any: any value gets that answer, not a type error.
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    audio: Any = None
    modalities: Any = None
    web_search_options: Any = None
    UNSUPPORTED = {
        **_GenerationRequest.UNSUPPORTED,
        "logprobs": Unsupported(_off, "log-probabilities are not returned"),
        "top_logprobs": Unsupported(_off, "log-probabilities are not returned"),
        "tools": Unsupported(_off, _TOOLS),
        "tool_choice": Unsupported(_none_or("none"), _TOOLS),
        "functions": Unsupported(_off, _TOOLS),
        "function_call": Unsupported(_none_or("none"), _TOOLS),
        "parallel_tool_calls": Unsupported(_absent, _TOOLS),
        "response_format": Unsupported(lambda v: v is None or v.get("type", "text") == "text",
                                       "the output is not constrained to JSON"),
        "audio": Unsupported(_absent, "the models write text only"),
        "modalities": Unsupported(_none_or(["text"]), "the models write text only"),
        "web_search_options": Unsupported(_absent, "there is no web search"),
    }

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        if not self.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        return template_messages(self.messages)


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: FailFastList[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def chat_messages(self) -> list[dict[str, str]]:
        return template_messages(self.messages or [])


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The messages as a chat template takes them; one that sets an unsupported field is a 400."""
    for i, m in enumerate(messages):
        m.check_supported(f"messages.{i}.")
    # "developer" is OpenAI's newer name for the system role; chat templates know "system". A
    # participant's name goes to the template as vLLM passes it (templates that know it render it).
    out = []
    for i, m in enumerate(messages):
        message = {"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


class PreloadRequest(_Request):
    """POST /v1/preload: a conversation so far (prompt, messages, or a saved session's name)
    whose cached KV the engine brings up while its user types (kvcache/preload.py)."""

    model: str | None = None
    prompt: str | None = None
    messages: FailFastList[ChatMessage] | None = None
    session: str | None = None
    add_generation_prompt: bool = False  # the history alone: the next turn's prompt starts with it
    timeout_ms: float = Field(10_000.0, gt=0, le=600_000)

    def chat_messages(self) -> list[dict[str, str]]:
        return template_messages(self.messages or [])


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: FailFastList[int] = Field(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _name_the_bad_token(cls, data: Any, handler: Any) -> Any:
        return _validated_naming_elements(handler, data, "tokens",
                                          "tokens must be a list of token ids (integers)")


def _validated_naming_elements(handler: Any, data: Any, name: str, fix: str,
                               forms_by_first: bool = False) -> Any:
    """Run pydantic's validation; a bad element of list field `name` is a 400 naming its index."""
    try:
        return handler(data)
    except ValidationError as e:
        error = _element_error(e, data, name, fix, forms_by_first=forms_by_first)
        if error is not None:
            raise error from None
        raise


def _element_error(e: ValidationError, data: Any, field: str, fix: str,
                  forms_by_first: bool = False) -> APIError | None:
    """`field`'s error in `e` as a 400 naming the element by its index (`prompt[3][1]`), what it
    is and the fix; None when `field` has no error or is missing. `forms_by_first`: the first
    element chose the list's form."""
    locs = (err["loc"] for err in e.errors(include_url=False) if err["loc"][:1] == (field,))
    loc = next(locs, None)
    if loc is None or not isinstance(data, dict) or data.get(field) is None:
        return None
    value = data[field]
    indices = [i for i in loc[1:] if type(i) is int]  # the others name the form: "token_ids"
    if not indices and type(value) is list and value:
        indices = [0]  # a first element that starts none of the forms
    context = ""
    if forms_by_first and len(indices) == 1 and indices[0] > 0:
        context = f" but {field}[0] is {json_kind(value[0])}"
    where = field + "".join(f"[{i}]" for i in indices)
    for i in indices:
        value = value[i]
    shown = f" ({shown_json(value)})" if isinstance(value, (bool, int, float, str)) else ""
    return APIError(400, f"{where} is {json_kind(value)}{shown}{context}; {fix}", param=field,
                    code="invalid_value")


def check_prompt_ids(prompt_ids: list[int], vocab_size: int, param: str) -> None:
    if not prompt_ids:
        raise APIError(400, f"the {param} is empty: give at least one token", param=param, code="invalid_value")
    if min(prompt_ids) >= 0 and max(prompt_ids) < vocab_size:  # C loops, unlike the list below
        return
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"token id(s) {bad[:5]} are outside the vocabulary [0, {vocab_size})", param=param,
                       code="invalid_value")


def resolve_max_tokens(num_prompt_tokens: int, requested: int | None, max_seq_len: int, max_tokens_limit: int,
                       kind: str) -> int:
    """Tokens to generate: the requested number (checked against the context and the server's cap), or as many
    as fit. Raises PromptTooLongError with vLLM's wording when the prompt and completion exceed the context."""
    where = "messages" if kind == "chat" else "prompt"
    if requested is not None:
        if requested < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {requested}", param="max_tokens",
                           code="invalid_value")
        if requested > max_tokens_limit:
            raise APIError(400, f"max_tokens={requested} is above this server's limit of {max_tokens_limit} "
                           "(--max-tokens-limit)", param="max_tokens", code="invalid_value")
    wanted = requested if requested is not None else 1
    if num_prompt_tokens + wanted > max_seq_len:
        raise PromptTooLongError(
            f"This model's maximum context length is {max_seq_len} tokens. However, you requested "
            f"{num_prompt_tokens + wanted} tokens ({num_prompt_tokens} in the {where}, {wanted} in the completion). "
            f"Please reduce the length of the {where} or completion.",
            max_model_len=max_seq_len, num_prompt_tokens=num_prompt_tokens,
        )
    if requested is not None:
        return requested
    return min(max_tokens_limit, max_seq_len - num_prompt_tokens)


def sampling_params(req: _GenerationRequest, max_tokens: int, seed: int | None) -> SamplingParams:
    """Validated sampling parameters of one choice (SamplingParamsError names the field)."""
    return SamplingParams(max_new_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                          top_k=req.top_k, seed=seed, stop=req.stop_strings(), ignore_eos=req.ignore_eos)
