"""What a trained model's receipts say their figures are, from the journal alone."""

from __future__ import annotations

from cache_family.schemas.host_identity import HostIdentity
from cache_family.schemas.journal import RunStarted
from cache_family.schemas.receipts import REAL_EVIDENCE_PREFIX
from cache_family.states.fold.lines import real_evidence_class


def _run(**members: object) -> RunStarted:
    return RunStarted(run_id="r", request_sha256="0" * 64, catalog_sha256="1" * 64, **members)  # type: ignore[arg-type]


def test_names_the_model_cpu_threads_load_and_no_gpu() -> None:
    run = _run(
        host=HostIdentity(hostname="h", cpu_count=2, cpu_model="AMD EPYC 7B13"),
        operator_threads="2",
        load_average=(1.52, 1.1, 0.9),
    )
    text = real_evidence_class(run, "org/gemma:Q4_K_M", (2.04, 1.5, 1.0))
    assert text == (
        f"{REAL_EVIDENCE_PREFIX}org/gemma:Q4_K_M on AMD EPYC 7B13 (2 CPUs), 2 threads, "
        "1-min load average 1.5 at run start, 2.0 when measured; no GPU: CPU figures, "
        "not a GPU claim"
    )


def test_names_the_gpus_a_host_has_and_what_it_does_not_know() -> None:
    run = _run(host=HostIdentity(hostname="h", gpus=("NVIDIA H100",)))
    text = real_evidence_class(run, "", None)
    assert text is not None
    assert "(model not named) on CPU model not given (CPU count not given)" in text
    assert "threads not set, load average not kept; GPUs on the host: NVIDIA H100" in text


def test_a_journal_that_kept_no_host_gives_no_class() -> None:
    """Journals written before the host was kept replay to the receipts they had."""
    assert real_evidence_class(_run(), "org/m", (1.0, 1.0, 1.0)) is None
    assert real_evidence_class(None, "org/m", None) is None
