"""The lab's top floor: what makes the outputs people read — the report (``kvstate report``), the regeneration
of every committed result it reads (``make reproduce``), and the ``kvstate lab`` commands. It imports every
axis slice; nothing below it imports it."""
