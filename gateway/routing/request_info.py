"""What the routing policy is told about a request: `policies.request.RequestInfo` from an API body."""

from __future__ import annotations

from specgate.gateway.backends.embedded.structured import wants_json
from specgate.gateway.protocol.schemas import ChatCompletionRequest, CompletionRequest
from specgate.policies.request import RequestInfo


def request_info(request: ChatCompletionRequest | CompletionRequest) -> RequestInfo:
    temperature = 1.0 if request.temperature is None else request.temperature
    top_p = request.top_p if request.top_p is not None else 1.0
    if isinstance(request, ChatCompletionRequest):
        texts, last_user = [], ""
        for m in request.messages:
            try:
                text = m.text()
            except ValueError:  # image parts etc.: the backend will judge them; the policy reads the text
                text = " ".join(str(p.get("text", "")) for p in m.content or [] if isinstance(p, dict))
            if m.role in ("system", "developer", "user"):
                texts.append(text)
            if m.role == "user":
                last_user = text
        fns = [t["function"] for t in request.tools or []]
        forced = isinstance(request.tool_choice, dict) or request.tool_choice == "required"
        return RequestInfo(
            text="\n\n".join(texts),
            last_user=last_user,
            tool_names=[str(f.get("name")) for f in fns],
            tool_descriptions=[str(f.get("description") or "") for f in fns],
            json_mode=wants_json(request) or (forced and bool(fns)),
            num_messages=len(request.messages),
            max_tokens=request.token_limit,
            temperature=temperature,
            top_p=top_p,
        )
    prompt = request.prompt
    if isinstance(prompt, str):
        text, tokens = prompt, None
    elif prompt and isinstance(prompt[0], str):
        text, tokens = str(prompt[0]), None
    else:  # token ids: no text to read, but an exact length
        first = prompt[0] if prompt and isinstance(prompt[0], list) else prompt
        text, tokens = "", len(first)
    return RequestInfo(
        text=text,
        last_user=text,
        prompt_tokens=tokens,
        json_mode=wants_json(request),
        max_tokens=request.max_tokens,
        temperature=temperature,
        top_p=top_p,
    )
