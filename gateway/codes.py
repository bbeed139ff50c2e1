"""The codes a client is refused with, one enum (`ClientCode`), at the bottom of the gateway's layers so any
module may name them."""

from __future__ import annotations

from enum import StrEnum


class ClientCode(StrEnum):
    """Every code a client is refused with (`ProtocolError.code`; on the wire, the value). Members, never strings:
    a misspelt member fails where it is named; tests/test_errors.py checks no `ProtocolError("...")` is left.
    The stages' client errors and admission refusals (`minicpmo_triton.errors.CLIENT_ERRORS`, `ADMISSION_REFUSALS`)
    keep their values here; a stage Triton could not run is `backend_unavailable`."""

    ADDRESS_SESSION_LIMIT = "address_session_limit"
    ALREADY_INITIALIZED = "already_initialized"
    BACKEND_UNAVAILABLE = "backend_unavailable"
    BAD_AUDIO = "bad_audio"
    BAD_IMAGE = "bad_image"
    CONVERSATION_ALREADY_HAS_ACTIVE_RESPONSE = "conversation_already_has_active_response"
    CONVERSATION_FULL = "conversation_full"
    EVENT_TOO_LARGE = "event_too_large"
    INIT_TIMEOUT = "init_timeout"
    INPUT_AUDIO_BUFFER_COMMIT_EMPTY = "input_audio_buffer_commit_empty"
    INPUT_AUDIO_BUFFER_FULL = "input_audio_buffer_full"
    INPUT_BACKPRESSURE = "input_backpressure"
    INPUT_TOO_LARGE = "input_too_large"
    INTERNAL_ERROR = "internal_error"
    INVALID_CHAT = "invalid_chat"
    INVALID_CONFIG = "invalid_config"
    INVALID_EVENT = "invalid_event"
    INVALID_FIRST_MESSAGE = "invalid_first_message"
    INVALID_JSON = "invalid_json"
    INVALID_MODE = "invalid_mode"
    INVALID_PAYLOAD = "invalid_payload"
    INVALID_RESUME_TOKEN = "invalid_resume_token"
    INVALID_VALUE = "invalid_value"
    INVALID_VOICE = "invalid_voice"
    ITEM_CREATE_DUPLICATE_ITEM_ID = "item_create_duplicate_item_id"
    ITEM_NOT_FOUND = "item_not_found"
    KEY_SESSION_LIMIT = "key_session_limit"
    MISSING_FIELD = "missing_field"
    NOT_READY = "not_ready"
    ORIGIN_NOT_ALLOWED = "origin_not_allowed"
    PLAYBACK_ACK_TOO_LATE = "playback_ack_too_late"
    POOL_FULL = "pool_full"  # the LLM's KV pool has no room for the session now (a stage's retryable refusal)
    QUEUE_FULL = "queue_full"
    RATE_LIMITED = "rate_limited"
    RESPONSE_CANCEL_NOT_ACTIVE = "response_cancel_not_active"
    SERVER_VAD_UNAVAILABLE = "server_vad_unavailable"
    SESSION_ELSEWHERE = "session_elsewhere"
    SESSION_RESUME_EXPIRED = "session_resume_expired"
    SESSION_UPDATE_NOT_ALLOWED = "session_update_not_allowed"
    TOO_MANY_SESSIONS = "too_many_sessions"
    UNAUTHORIZED = "unauthorized"
    UNKNOWN_ENDPOINT = "unknown_endpoint"  # the admin drain call names an endpoint this gateway does not list
    UNKNOWN_EVENT = "unknown_event"
    UNKNOWN_RESPONSE = "unknown_response"
    UNSUPPORTED_AUDIO_FORMAT = "unsupported_audio_format"
    UNSUPPORTED_EVENT = "unsupported_event"

    def __str__(self) -> str:  # the value, in f-strings and logs
        return self.value
