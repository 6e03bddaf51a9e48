// What this test binary was built with, for the few tests whose measure a build changes.
#pragma once

namespace zt::test {

// AddressSanitizer keeps freed memory in a quarantine, so a bound on resident memory does not
// hold in the sanitizer build (the behaviour checks around it still run there).
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kAddressSanitizer = true;
#else
inline constexpr bool kAddressSanitizer = false;
#endif
#else
inline constexpr bool kAddressSanitizer = false;
#endif

}  // namespace zt::test
