#!/usr/bin/env python3
# fuzz/strip_package.py REAL.pt2 SEED.pt2 [WRAPPER.cpp] (with the venv's python: it needs torch).
# A fuzz seed from a real .pt2: the same records in the same order, the compiled library
# and the kernels' source emptied (read_graph_signature never reads them, and they are
# nine tenths of the file), the wrapper's source cut to what it reads (the model's
# constructor through the input checks), so that each input costs little to run.
import zipfile, sys, torch
src, dst = sys.argv[1], sys.argv[2]
z = zipfile.ZipFile(src)
w = torch._C.PyTorchFileWriter(dst)
for info in z.infolist():
    name = info.filename.split('/', 1)[1]
    if name in ('.data/version', '.data/serialization_id', 'byteorder'):
        continue
    data = b'' if name.endswith(('.so', 'kernel.cpp')) else z.read(info)
    if name.endswith('wrapper.cpp'):
        text = data.decode()
        begin = text.rfind('\n', 0, text.index('AOTInductorModelBase(') - 100) + 1
        end = text.find('static bool _check_aoti_runtime_check_inputs_env')
        data = text[begin:end if end > 0 else len(text)].encode()
        if len(sys.argv) > 3:
            open(sys.argv[3], 'wb').write(data)
    w.write_record(name, data, len(data))
w.write_end_of_file()
