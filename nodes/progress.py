"""ComfyUI's progress bar and Cancel button for the pack's decodes (``fastpath.progress``)."""
from __future__ import annotations


def comfy_progress(bar: bool = True):
    """A ``fastpath.progress`` report: moves ComfyUI's progress bar of the running node (when
    ``bar``) and raises ComfyUI's interrupt exception between chunks once Cancel was pressed."""
    import comfy.model_management as mm
    import comfy.utils

    progress = None

    def report(done: int, total: int) -> None:
        nonlocal progress
        if bar:
            if progress is None:
                progress = comfy.utils.ProgressBar(total)
            progress.update_absolute(done, total)
        if done < total:
            mm.throw_exception_if_processing_interrupted()

    return report
