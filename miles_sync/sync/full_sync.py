"""Full-weight syncs of a fleet: the transport opened when none is, then one session (miles_sync.sync.session) per
sync, with a progress bar and the opt-in mechanism check.

`mechanism_check=True` proves the update mechanism once, on the first sync while the fleet is at version 0 (no
sync ever committed to it, usually version 0 -> 1): the session snapshots the engines' weights, resets them to
random values, syncs, and compares with the snapshot, so a parameter the sync never writes is named. It is
meaningful only when the trainer's weights at that sync equal what the engines loaded at start (e.g. a first sync
straight from the checkpoint both loaded): otherwise the compare fails and every engine stays paused, holding random
weights, until a later sync verifies on it. Later syncs never run it; a first sync of a fleet already past version 0
skips it with a warning in the report.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

from miles_sync.sync.fleet import Fleet
from miles_sync.sync.report import BucketProgress, ProgressBar, SyncProgress, SyncReport, failed_report
from miles_sync.sync.routing import RouteKeeper
from miles_sync.sync.session import SelectorInputs, SessionTimeouts, run_sync_session
from miles_sync.sync.update_group import UpdateGroup
from miles_sync.sync.weight_source import WeightSource
from miles_sync.weights.fp8 import Fp8Block
from miles_sync.wire.protocol import PauseMode


class FullSync:
    """How a controller runs a full-weight sync (module docstring); `progress` is the running (or last) sync's
    acknowledged buckets so far."""

    def __init__(
        self,
        *,
        source: WeightSource,
        group: UpdateGroup,
        routes: RouteKeeper,
        transport: str,
        selector_inputs: SelectorInputs,
        pause_mode: PauseMode,
        verify: bool,
        staged: bool,
        timeouts: SessionTimeouts,
        quantization: Fp8Block | None,
        mechanism_check: bool,
        show_progress: bool,
    ) -> None:
        self._source = source
        self._group = group
        self._routes = routes
        self._transport = transport
        self._selector_inputs = selector_inputs
        self._pause_mode = pause_mode
        self._verify = verify
        self._staged = staged
        self._timeouts = timeouts
        self._quantization = quantization  # what the source sends: checked against each engine before the pause
        # Cleared by the first sync: the check needs weights no sync has touched yet.
        self._is_mechanism_check_pending = mechanism_check
        self._show_progress = show_progress
        self.progress: SyncProgress | None = None

    async def run(self, fleet: Fleet, *, version: str, previous_version: str, committed_version: int) -> SyncReport:
        """Sync every engine of `fleet` to `version`; `previous_version`: the version string the fleet serves,
        `committed_version`: the last committed number. Never raises for a failed sync: see the report."""
        start = time.perf_counter()
        error = await self._group.open(fleet)
        if error:
            return failed_report(
                version=version,
                previous_version=previous_version,
                transport=self._transport,
                engines=fleet.records,
                error=error,
                total_s=time.perf_counter() - start,
            )
        bar = ProgressBar(description=f"sync v{version}", is_enabled=self._show_progress)
        self.progress = SyncProgress(version=version, buckets=())

        def on_bucket(event: BucketProgress) -> None:
            self.progress = replace(self.progress, buckets=(*self.progress.buckets, event))
            bar.update(event)

        async def withdraw_before_resume(held: Sequence[str]) -> list[str]:
            """Every engine the session leaves paused leaves the router before anything resumes; never raises."""
            reason = f"held before the resume of v{version}"
            return await self._routes.withdraw_routed(fleet, held, version=previous_version, reason=reason)

        mechanism_check, skipped = self._take_mechanism_check(version, committed_version=committed_version)
        try:
            report = await run_sync_session(
                engines=[r.client for r in fleet.records],
                source=self._source,
                version=version,
                previous_version=previous_version,
                selector_inputs=self._selector_inputs,
                pause_mode=self._pause_mode,
                verify=self._verify,
                staged=self._staged,
                timeouts=self._timeouts,
                transport_name=self._transport,
                on_bucket=on_bucket,
                baselines=fleet.baselines,
                held=tuple(fleet.held),
                mechanism_check=mechanism_check,
                quantization=self._quantization,
                draft_baselines=fleet.draft_baselines,
                before_resume=withdraw_before_resume,
            )
        finally:
            bar.close()
        return replace(report, warnings=(*report.warnings, skipped)) if skipped else report

    def _take_mechanism_check(self, version: str, *, committed_version: int) -> tuple[bool, str]:
        """(run the mechanism check in this sync, the warning when it is skipped): only the first sync may, and only
        while the fleet is at version 0."""
        if not self._is_mechanism_check_pending:
            return False, ""
        self._is_mechanism_check_pending = False
        if committed_version == 0:
            return True, ""
        return False, (
            f"mechanism check skipped: the fleet is at version {committed_version}, not 0 (its weights are no longer "
            f"the ones it loaded at start), so sync v{version} ran without it"
        )
