// Device families, indexed forms, folder names and the error for an unknown family.

#include "reference.hpp"

using namespace neml2;

TEST_CASE("every known family parses, bare and indexed") {
  for (auto family : known_device_families) {
    const std::string n(name(family));
    const Device bare = n;
    CHECK(bare.family() == family);
    CHECK_FALSE(bare.has_index());
    CHECK(bare.str() == n);
    CHECK(bare.folder() == n);
    CHECK(bare.is_accelerator() == (family != DeviceFamily::cpu));

    const Device pinned = n + ":3";
    CHECK(pinned.family() == family);
    CHECK(pinned.index() == 3);
    CHECK(pinned.str() == n + ":3");
    CHECK(pinned.folder() == n);
  }
}

TEST_CASE("devices convert to and from torch's") {
  CHECK(Device("cuda:1").torch() == c10::Device(c10::DeviceType::CUDA, 1));
  CHECK(Device("cpu").torch() == c10::Device(c10::kCPU));
  CHECK(Device("mps").torch().type() == c10::DeviceType::MPS);
  CHECK(Device(c10::Device("xpu:2")) == Device("xpu:2"));
  CHECK(Device(c10::Device(c10::DeviceType::HIP, 0)).str() == "hip:0");
  CHECK(test::fatal_message([] {
          return Device(c10::Device(c10::DeviceType::Meta));
        }).find("no known family") != std::string::npos);
}

TEST_CASE("an unknown family is an error that lists the known ones") {
  for (const auto* bad : {"gpu", "CUDA", "", "tpu:0"}) {
    const auto message = test::fatal_message([&] { return Device(bad); });
    CHECK(message.find("unknown device family") != std::string::npos);
    CHECK(message.find("cpu, cuda, xpu, hip, mps") != std::string::npos);
  }
}

TEST_CASE("a bad index is an error that shows the form") {
  for (const auto* bad : {"cuda:", "cuda:x", "cuda:-1", "cuda:1x"}) {
    const auto message = test::fatal_message([&] { return Device(bad); });
    CHECK(message.find("bad device index") != std::string::npos);
    CHECK(message.find("'cuda:0'") != std::string::npos);
  }
}

TEST_CASE("an index torch cannot address is refused when the name is parsed") {
  const auto limit = std::numeric_limits<c10::DeviceIndex>::max();
  CHECK(Device("cuda:" + std::to_string(limit)).torch().index() == limit);
  for (const auto* bad : {"cuda:256", "cuda:128", "xpu:100000"}) {
    CAPTURE(bad);
    const auto message = test::fatal_message([&] { return Device(bad); });
    CHECK(message.find("out of range") != std::string::npos);
    CHECK(message.find("0 to " + std::to_string(limit)) != std::string::npos);
  }
  // Made from a family and an index: refused where torch's device is asked for.
  CHECK(test::fatal_message([] {
          return Device(DeviceFamily::cuda, 256).torch();
        }).find("out of range") != std::string::npos);
}
