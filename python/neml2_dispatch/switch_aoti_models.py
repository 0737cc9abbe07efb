"""Imported, makes every ``type = AOTIModel`` block NEML2's factory loads a
``DispatchedAOTIModel`` (SyncChunking on the load's device): what ``neml2-run --load
neml2_dispatch.switch_aoti_models INPUT DRIVER`` runs a stub's driver with."""

from .drop_in import dispatch_aoti_models

dispatch_aoti_models()
