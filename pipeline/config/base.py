"""Section, the base of every config model, and what every section checks of a URI."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from pipeline.config.env import redact_url, url_credentials


class Section(BaseModel):
    """Every config model: an unknown field is an error, not a silent default; no number is infinite or NaN
    (an infinite lease or temperature would fail a job hours in, not at load)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def no_credentials(uri: str | None) -> str | None:
    """Refuse a storage URI that carries a password: it would be stored in the catalog, written into
    manifests and shown in every message naming the URI. Object storage takes credentials from the AWS
    chain instead (the message shows the URI redacted)."""
    if uri and url_credentials(uri) is not None:
        raise ValueError(
            f"credentials in a URI are not supported ({redact_url(uri)}); object storage takes "
            "them from the AWS chain (environment variables, profile, instance or pod role)"
        )
    return uri
