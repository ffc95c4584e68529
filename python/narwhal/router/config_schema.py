"""The router config's JSON Schema: what `narwhal serve` checks a YAML file against before
anything listens (config.py parses what passes; config_doc.py renders docs/CONFIG.md)."""

from __future__ import annotations

from typing import Any

DIALECTS = ("lexi", "vllm", "sglang", "llamacpp", "openai")
TOKEN_ID_DIALECTS = frozenset({"lexi", "vllm"})

_pos_int = {"type": "integer", "minimum": 1}
_pos_num = {"type": "number", "exclusiveMinimum": 0}
_env_name = {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"}
# A model's name as clients and engines write it (an adapter's too: `base:sql`, `org/name`).
MODEL_NAME = "[A-Za-z0-9][A-Za-z0-9_.:/@+-]{0,255}"
_model_name = {"type": "string", "pattern": f"^{MODEL_NAME}$"}
_model_names = {"type": "array", "items": _model_name, "minItems": 1, "uniqueItems": True}

SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "aliases": {
            "type": "object",
            "propertyNames": _model_name,
            "additionalProperties": _model_name,
        },
        "listen": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "host": {"type": "string", "minLength": 1},
                "port": {"type": "integer", "minimum": 0, "maximum": 65535},
            },
        },
        "admission": {"enum": ["predictive", "open"]},
        "serving": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "max_request_bytes": _pos_int,
                "http_retention_limit": _pos_int,
                "request_timeout_s": _pos_num,
                "shutdown_grace_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 3600},
                "header_timeout_s": _pos_num,
                "body_timeout_s": _pos_num,
                "max_connections": _pos_int,
                "stream_idle_timeout_s": _pos_num,
                "drain_timeout_s": _pos_num,
                "native_relay": {"type": "boolean"},
                "cpu_affinity": {
                    "anyOf": [
                        {"enum": ["auto", "none"]},
                        {
                            "type": "array",
                            "minItems": 1,
                            "uniqueItems": True,
                            "items": {"type": "integer", "minimum": 0},
                        },
                    ]
                },
            },
        },
        "queue": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"size": {"type": "integer", "minimum": 0}, "wait_s": _pos_num},
        },
        "phases": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"prefill_concurrency": _pos_int, "decode_concurrency": _pos_int},
        },
        "predictive": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "ttft_budget_s": _pos_num,
                "drift_bound": _pos_num,
                "drift_min_samples": _pos_int,
                "stale_after_s": _pos_num,
                "probe_interval_s": _pos_num,
                "warm_refused": {"type": "boolean"},
                "tpot_target_s": _pos_num,
                "sheddable_headroom": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                "critical_reserve": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
            },
        },
        "prefix_cache": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "tokens_per_engine": {"type": "integer", "minimum": 0},
                "block_bytes": {"type": "integer", "minimum": 64, "maximum": 65536},
            },
        },
        "health": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"interval_s": _pos_num, "timeout_s": _pos_num, "eject_after": _pos_int},
        },
        "ha": {
            "type": "object",
            "additionalProperties": False,
            "required": ["etcd"],
            "properties": {
                "etcd": {
                    "type": "array",
                    "minItems": 1,
                    "items": {"type": "string", "pattern": "^https?://"},
                },
                "key": {"type": "string", "pattern": "^/"},
                "lease_ttl_s": {"type": "integer", "minimum": 2, "maximum": 300},
                "resign_unhealthy_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 3600},
                "fence_secret_env": _env_name,
                "mode": {"enum": ["standby", "active"]},
                "peer_secret_env": _env_name,
                "advertise_url": {"type": "string", "pattern": "^https?://[^/?#]+$"},
                "advertise_url_env": _env_name,
            },
        },
        "auth": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "api_keys": {
                    "type": "array",
                    "items": {
                        "anyOf": [
                            {"type": "string", "minLength": 1},
                            {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["tenant"],
                                "properties": {
                                    "key": {"type": "string", "minLength": 1},
                                    "key_env": _env_name,
                                    "tenant": {
                                        "type": "string",
                                        "pattern": "^[A-Za-z0-9_.-]{1,64}$",
                                    },
                                    "rpm": _pos_int,
                                    "tpm": _pos_int,
                                    "max_concurrent": _pos_int,
                                    "priority": {"enum": ["critical", "standard", "sheddable"]},
                                    "models": _model_names,
                                },
                                "oneOf": [{"required": ["key"]}, {"required": ["key_env"]}],
                            },
                        ]
                    },
                },
                "api_keys_env": _env_name,
            },
        },
        "telemetry": {
            "type": "object",
            "additionalProperties": False,
            "required": ["otlp_endpoint"],
            "properties": {
                "otlp_endpoint": {"type": "string", "pattern": "^https?://[^/]"},
                "service_name": {"type": "string", "minLength": 1, "maxLength": 256},
                "sample_ratio": {"type": "number", "minimum": 0, "maximum": 1},
            },
        },
        "admin": {
            "type": "object",
            "additionalProperties": False,
            "required": ["token_env"],
            "properties": {
                "token_env": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                "decision_records": {"type": "integer", "minimum": 0, "maximum": 1_000_000},
            },
        },
        "engines_from": {
            "type": "object",
            "additionalProperties": False,
            "minProperties": 1,
            "properties": {
                "allow": {"type": "array", "items": {"type": "string", "minLength": 1}},
                "api_key_envs": {"type": "array", "items": _env_name},
                "etcd": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["endpoints", "prefix"],
                    "properties": {
                        "endpoints": {
                            "type": "array",
                            "minItems": 1,
                            "items": {"type": "string", "pattern": "^https?://"},
                        },
                        "prefix": {"type": "string", "pattern": "^/"},
                    },
                },
                "dns": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name", "port"],
                    "properties": {
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                        "dialect": {"enum": list(DIALECTS)},
                        "every_s": _pos_num,
                        "nameserver": {"type": "string", "minLength": 1},
                        "api_key_env": _env_name,
                        "models": {"anyOf": [_model_names, {"const": "auto"}]},
                    },
                },
            },
        },
        "engines": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]+$"},
                    "url": {"type": "string", "pattern": "^https?://"},
                    "dialect": {"enum": list(DIALECTS)},
                    "api_key_env": _env_name,
                    "models": {"anyOf": [_model_names, {"const": "auto"}]},
                    "launch": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["model"],
                        "properties": {
                            "model": {"type": "string", "minLength": 1},
                            "parallel": _pos_int,
                            "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                            "args": {"type": "array", "items": {"type": "string"}},
                        },
                    },
                },
                "oneOf": [{"required": ["url"]}, {"required": ["launch"]}],
            },
        },
    },
}
