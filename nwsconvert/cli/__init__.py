"""The command lines, one module per console script: ``nws-train`` (:mod:`.train`), ``nws-info``
(:mod:`.info`), ``nws-report`` (:mod:`.report`), ``make demo`` (:mod:`.demo`), and what they
share (:mod:`.common`). ``nws-export`` / ``nws-infer`` live with the exporter
(``nwsconvert.export.cli``)."""
