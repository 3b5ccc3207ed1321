"""Request and response bodies of the OpenAI-compatible API (pydantic v2).

Requests are strict: wrong JSON types are rejected rather than coerced, and an unknown top-level field is
an error (as with OpenAI's "Unrecognized request argument"), so nothing a client asks for is silently
ignored. Chat messages tolerate the extra null fields the `openai` client echoes back from a response
(`refusal`, `annotations`, `audio`, `function_call`). Responses are plain models dumped to JSON as is.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# ----------------------------------------------------------------------------------------------- requests

class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Strict):
    name: str = Field(min_length=1)
    arguments: str


class ToolCallIn(_Strict):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    # echoed back by clients that append a response message to the history; must be empty
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _role_fields(self):
        if self.role != "assistant" and (self.tool_calls is not None or self.reasoning_content is not None
                                         or self.reasoning is not None):
            raise ValueError("tool_calls / reasoning_content are only allowed on assistant messages, "
                             f"not {self.role!r}")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError(f"tool_call_id is only allowed on tool messages, not {self.role!r}")
        if self.role in ("system", "developer", "user", "tool") and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        return self


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class ToolChoiceFunction(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchema(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format.json_schema is required exactly when type is 'json_schema'")
        return self


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatTemplateKwargs(_Strict):
    thinking: bool = True


class _Sampling(_Strict):
    """Fields shared by chat and completion requests."""
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    n: int = Field(1, ge=1, le=16)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _common(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("stop: at most 16 non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                raise ValueError(f"{name}={getattr(self, name)} is not supported (only 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.top_k == 0:
            raise ValueError("top_k: 0 is not allowed; use -1 or null to disable top-k")
        return self

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["low", "high", "max"] | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

    @model_validator(mode="after")
    def _chat(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError(f"max_tokens={self.max_tokens} and max_completion_tokens="
                             f"{self.max_completion_tokens} disagree; give one")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError(f"tool_choice={self.tool_choice!r} needs tools")
        if self.store:
            raise ValueError("store=true is not supported")
        if self.parallel_tool_calls is False:
            raise ValueError("parallel_tool_calls=false is not supported (the model may call several tools)")
        return self

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def thinking(self) -> bool:
        return self.chat_template_kwargs.thinking if self.chat_template_kwargs else True


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _completion(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not supported (only best_of == n)")
        if isinstance(self.prompt, (str, list)) and len(self.prompt) == 0:
            raise ValueError("prompt must not be empty")
        if isinstance(self.prompt, list) and any(isinstance(p, (str, list)) and len(p) == 0 for p in self.prompt):
            raise ValueError("prompt must not contain empty prompts")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts (a string, or a list of token ids each)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


# ----------------------------------------------------------------------------------------------- responses

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "k3"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
