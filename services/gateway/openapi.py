"""The gateway's OpenAPI 3 description (served at ``/openapi.json``; the fuzz test reads it).

It states what the gateway accepts with its default settings (--max-stop 16,
--max-client-priority 10); anything else is a 4xx with an OpenAI error object.
"""

from __future__ import annotations

from typing import Any

_NUMBER = {"type": "number"}
_STOP_STRING = {"type": "string", "minLength": 1, "maxLength": 1024}
_STOP = {
    "oneOf": [
        _STOP_STRING,
        {"type": "array", "items": _STOP_STRING, "maxItems": 16},
        {"type": "null"},
    ]
}
_COMMON: dict[str, Any] = {
    "model": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {**_NUMBER, "minimum": 0, "maximum": 2},
    "top_p": {**_NUMBER, "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer"},
    "min_p": {**_NUMBER, "minimum": 0, "maximum": 1},
    "n": {"type": "integer", "minimum": 1},
    "seed": {"type": "integer"},
    "stop": _STOP,
    "stream": {"type": "boolean"},
    "stream_options": {
        "type": "object",
        "properties": {
            "include_usage": {"type": "boolean"},
            "continuous_usage_stats": {"type": "boolean"},
        },
    },
    "presence_penalty": {**_NUMBER, "minimum": -2, "maximum": 2},
    "frequency_penalty": {**_NUMBER, "minimum": -2, "maximum": 2},
    "repetition_penalty": {**_NUMBER, "minimum": 0.01, "maximum": 2},
    "stop_token_ids": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0},
        "maxItems": 256,
    },
    "priority": {"type": "integer", "minimum": -10, "maximum": 10},
    "ignore_eos": {"type": "boolean"},
    "min_tokens": {"type": "integer", "minimum": 0},
    "include_stop_str_in_output": {"type": "boolean"},
    "skip_special_tokens": {"type": "boolean"},
    "user": {"type": "string"},
    "logit_bias": {
        "type": "object",
        "propertyNames": {"pattern": "^[0-9]+$"},
        "additionalProperties": {**_NUMBER, "minimum": -100, "maximum": 100},
        "maxProperties": 1024,
    },
    "allowed_token_ids": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0},
        "minItems": 1,
        "maxItems": 16384,
    },
    "bad_words": {
        "type": "array",
        "items": {"type": "string", "minLength": 1, "maxLength": 256, "pattern": "\\S"},
        "maxItems": 128,
    },
    "prompt_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    "truncate_prompt_tokens": {
        "oneOf": [{"const": -1}, {"type": "integer", "minimum": 1, "maximum": 8192}]
    },
}
_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                "description": {"type": "string"},
                "parameters": {"type": "object"},
            },
        },
    },
}
_TEXT = {"type": "string", "minLength": 1}
_TEXTS = {"oneOf": [_TEXT, {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": 64}]}
_RESPONSES_TOOL = {
    "type": "object",
    "required": ["type", "name"],
    "properties": {
        "type": {"const": "function"},
        "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
        "parameters": {"type": "object"},
    },
}
_ERROR = {
    "description": "An OpenAI error object",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["error"],
                "properties": {
                    "error": {
                        "type": "object",
                        "required": ["message", "type"],
                        "properties": {
                            "message": {"type": "string"},
                            "type": {"type": "string"},
                            "param": {"type": ["string", "null"]},
                            "code": {"type": ["string", "null"]},
                        },
                    }
                },
            }
        }
    },
}
_RESPONSES = {
    "200": {"description": "A completion (JSON), or an SSE stream when stream is true"},
    "400": _ERROR,
    "401": _ERROR,
    "404": _ERROR,
    "413": _ERROR,
    "429": _ERROR,
    "503": _ERROR,
    "504": _ERROR,
}


def _body(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": required}
    return {"required": True, "content": {"application/json": {"schema": schema}}}


SPEC: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "meshserve", "version": "1"},
    "paths": {
        "/v1/completions": {
            "post": {
                "operationId": "createCompletion",
                "requestBody": _body(
                    {
                        **_COMMON,
                        "prompt": {
                            "oneOf": [
                                {"type": "string"},
                                {"type": "array", "items": {"type": "integer", "minimum": 0}},
                                {"type": "array", "items": {"type": "string"}, "maxItems": 8},
                                {
                                    "type": "array",
                                    "items": {
                                        "type": "array",
                                        "items": {"type": "integer", "minimum": 0},
                                    },
                                    "maxItems": 8,
                                },
                            ]
                        },
                        "logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
                        "echo": {"type": "boolean"},
                    },
                    ["prompt"],
                ),
                "responses": _RESPONSES,
            }
        },
        "/v1/chat/completions": {
            "post": {
                "operationId": "createChatCompletion",
                "requestBody": _body(
                    {
                        **_COMMON,
                        "messages": {
                            "type": "array",
                            "minItems": 1,
                            "items": {
                                "type": "object",
                                "required": ["role", "content"],
                                "properties": {
                                    "role": {
                                        "type": "string",
                                        "enum": ["system", "user", "assistant"],
                                    },
                                    "content": {"type": "string"},
                                },
                            },
                        },
                        "response_format": {
                            "type": "object",
                            "required": ["type"],
                            "properties": {
                                "type": {"enum": ["text", "json_object", "json_schema"]},
                                "json_schema": {
                                    "type": "object",
                                    "required": ["name"],
                                    "properties": {
                                        "name": {"type": "string"},
                                        "schema": {"type": "object"},
                                        "strict": {"type": "boolean"},
                                    },
                                },
                            },
                        },
                        "tools": {"type": "array", "items": _TOOL, "maxItems": 128},
                        "include_reasoning": {"type": "boolean"},
                        "tool_choice": {
                            "oneOf": [
                                {"enum": ["none", "auto", "required"]},
                                {
                                    "type": "object",
                                    "required": ["type", "function"],
                                    "properties": {
                                        "type": {"const": "function"},
                                        "function": {
                                            "type": "object",
                                            "required": ["name"],
                                            "properties": {"name": {"type": "string"}},
                                        },
                                    },
                                },
                            ]
                        },
                        "max_completion_tokens": {"type": "integer", "minimum": 1},
                        "logprobs": {"type": "boolean"},
                        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
                    },
                    ["messages"],
                ),
                "responses": _RESPONSES,
            }
        },
        "/v1/embeddings": {
            "post": {
                "operationId": "createEmbedding",
                "requestBody": _body(
                    {
                        "model": {"type": "string"},
                        "input": {
                            "oneOf": [
                                {"type": "string", "minLength": 1},
                                {"type": "array", "items": {"type": "integer", "minimum": 0}},
                                {
                                    "type": "array",
                                    "items": {"type": "string", "minLength": 1},
                                    "maxItems": 2048,
                                },
                                {
                                    "type": "array",
                                    "items": {
                                        "type": "array",
                                        "items": {"type": "integer", "minimum": 0},
                                    },
                                    "maxItems": 2048,
                                },
                            ]
                        },
                        "encoding_format": {"enum": ["float", "base64"]},
                        "dimensions": {"type": "integer", "minimum": 1},
                        "normalize": {"type": "boolean"},
                        "user": {"type": "string"},
                        "priority": _COMMON["priority"],
                        "truncate_prompt_tokens": _COMMON["truncate_prompt_tokens"],
                    },
                    ["input"],
                ),
                "responses": {**_RESPONSES, "200": {"description": "The inputs' embeddings"}},
            }
        },
        "/v1/responses": {
            "post": {
                "operationId": "createResponse",
                "requestBody": _body(
                    {
                        "model": {"type": "string"},
                        "input": {
                            "oneOf": [
                                {"type": "string"},
                                {
                                    "type": "array",
                                    "minItems": 1,
                                    "maxItems": 8,
                                    "items": {
                                        "type": "object",
                                        "required": ["role", "content"],
                                        "properties": {
                                            "role": {"enum": ["system", "user", "assistant"]},
                                            "content": {"type": "string"},
                                        },
                                    },
                                },
                            ]
                        },
                        "instructions": {"type": "string"},
                        "max_output_tokens": {"type": "integer", "minimum": 1},
                        "temperature": _COMMON["temperature"],
                        "top_p": _COMMON["top_p"],
                        "stream": {"type": "boolean"},
                        "tools": {"type": "array", "maxItems": 8, "items": _RESPONSES_TOOL},
                        "tool_choice": {"enum": ["none", "auto", "required"]},
                        "text": {
                            "type": "object",
                            "properties": {
                                "format": {
                                    "type": "object",
                                    "required": ["type"],
                                    "properties": {"type": {"enum": ["text", "json_object"]}},
                                }
                            },
                        },
                    },
                    ["input"],
                ),
                "responses": {**_RESPONSES, "200": {"description": "A response, or its events"}},
            }
        },
        "/v1/score": {
            "post": {
                "operationId": "score",
                "requestBody": _body(
                    {
                        "model": {"type": "string"},
                        "text_1": _TEXTS,
                        "text_2": _TEXTS,
                        "priority": _COMMON["priority"],
                        "truncate_prompt_tokens": _COMMON["truncate_prompt_tokens"],
                    },
                    ["text_1", "text_2"],
                ),
                "responses": {**_RESPONSES, "200": {"description": "Each pair's score"}},
            }
        },
        "/v1/rerank": {
            "post": {
                "operationId": "rerank",
                "requestBody": _body(
                    {
                        "model": {"type": "string"},
                        "query": {"type": "string", "minLength": 1},
                        "documents": {"type": "array", "items": _TEXT, "minItems": 1},
                        "top_n": {"type": "integer", "minimum": 0},
                        "priority": _COMMON["priority"],
                        "truncate_prompt_tokens": _COMMON["truncate_prompt_tokens"],
                    },
                    ["query", "documents"],
                ),
                "responses": {**_RESPONSES, "200": {"description": "The documents, ranked"}},
            }
        },
        "/tokenize": {
            "post": {
                "operationId": "tokenize",
                "requestBody": _body(
                    {
                        "model": {"type": "string"},
                        "prompt": {"type": "string"},
                        "add_special_tokens": {"type": "boolean"},
                        "return_token_strs": {"type": "boolean"},
                    },
                    ["prompt"],
                ),
                "responses": _RESPONSES,
            }
        },
        "/detokenize": {
            "post": {
                "operationId": "detokenize",
                "requestBody": _body(
                    {
                        "model": {"type": "string"},
                        "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                    },
                    ["tokens"],
                ),
                "responses": _RESPONSES,
            }
        },
        "/v1/models": {
            "get": {
                "operationId": "listModels",
                "responses": {"200": {"description": "The served model"}},
            }
        },
        "/health": {
            "get": {
                "operationId": "health",
                "responses": {"200": {"description": "ready"}, "503": {"description": "not"}},
            }
        },
    },
}
