#pragma once

// Fields of a JSON file read by name (metadata.json, a tune file), for every file the
// library reads: a field missing, of another JSON type, or an integer that is not one or
// does not fit its type is a FatalError in that file's own words, naming the field.

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <neml2/errors.hpp>

namespace neml2::detail {

/// "segments[0].package": `key` of the object at `field` ("" at the top: the key alone).
inline std::string field_path(const std::string& field, const std::string& key) {
  return field.empty() ? key : field + "." + key;
}

/// What is wrong with a field; each kind of file words it its own way (JsonFields::words).
struct FieldProblem {
  enum class Kind {
    missing,      ///< the object has no such key
    wrong_type,   ///< not the JSON type `expected` names
    not_integer,  ///< a number that is not an integer, where an integer belongs
    out_of_range, ///< an integer outside the range `expected` gives
  };
  Kind kind = Kind::missing;
  const nlohmann::json* value = nullptr; ///< what the field holds (none when missing)
  std::string expected = {};             ///< "an array", "an integer from 0 to 255"
  std::string converter_message = {};    ///< nlohmann's own words, when its conversion failed
};

/// @brief Reads fields of one JSON document by name; `field` is the path of the object
/// read from ("segments[0]", "" at the top). A reader of one kind of file derives from
/// it and gives that file's messages (message(), words()).
///
/// Integers are checked before nlohmann converts them: it converts with a plain cast, so
/// 1e300 or 2^64 - 1 read as std::int64_t was undefined behaviour (found by fuzz_metadata),
/// and 2^32 + 2 read as int silently became 2. A number field takes no true or false
/// (nlohmann would read them as 1 and 0).
class JsonFields {
public:
  virtual ~JsonFields() = default;

  /// The file's message for `problem` of `field`, thrown as a FatalError.
  [[noreturn]] void fail(const std::string& field, const std::string& problem) const {
    throw FatalError(message(field, problem));
  }
  /// The same, for a problem the reader found.
  [[noreturn]] void fail(const std::string& field, const FieldProblem& problem) const {
    fail(field, words(problem));
  }

  /// `object[key]`; a FatalError when `object` is not an object or has no `key`.
  const nlohmann::json& at(const nlohmann::json& object, const std::string& key,
                           const std::string& field) const {
    if (!object.is_object())
      fail(field, FieldProblem{.kind = FieldProblem::Kind::wrong_type,
                               .value = &object,
                               .expected = "an object"});
    const auto it = object.find(key);
    if (it == object.end())
      fail(field_path(field, key), FieldProblem{.kind = FieldProblem::Kind::missing});
    return *it;
  }

  /// `object[key]`, which must be an array.
  const nlohmann::json& array(const nlohmann::json& object, const std::string& key,
                              const std::string& field) const {
    return of_type(object, key, field, nlohmann::json::value_t::array, "an array");
  }

  /// `parent[key]`, which must be an object: a section whose own fields are read by name.
  const nlohmann::json& object(const nlohmann::json& parent, const std::string& key,
                               const std::string& field) const {
    return of_type(parent, key, field, nlohmann::json::value_t::object, "an object");
  }

  /// `object[key]` as a T (an integer type: a JSON integer that fits it; a vector of them:
  /// each element).
  template <class T>
  T get(const nlohmann::json& object, const std::string& key, const std::string& field) const {
    const auto& v = at(object, key, field);
    const auto where = field_path(field, key);
    check_numbers<T>(v, where);
    T value;
    try {
      value = v.get<T>();
    } catch (const nlohmann::json::exception& e) {
      fail(where, FieldProblem{.kind = FieldProblem::Kind::wrong_type,
                               .value = &v,
                               .expected = expected_of<T>(),
                               .converter_message = e.what()});
    }
    return value;
  }

  /// get(), or `fallback` when `object` has no `key`.
  template <class T>
  T get_or(const nlohmann::json& object, const std::string& key, const std::string& field,
           T fallback) const {
    return object.contains(key) ? get<T>(object, key, field) : fallback;
  }

  /// get_or(), with null read as absent: a field its writer leaves null for "none".
  template <class T>
  T get_nullable(const nlohmann::json& object, const std::string& key, const std::string& field,
                 T fallback) const {
    const auto it = object.find(key);
    return it == object.end() || it->is_null() ? fallback : get<T>(object, key, field);
  }

protected:
  /// The whole message for `problem` (words, or the caller's own) of `field`.
  [[nodiscard]] virtual std::string message(const std::string& field,
                                            const std::string& problem) const = 0;
  /// A problem the reader found, in the file's words ("missing", "is missing").
  [[nodiscard]] virtual std::string words(const FieldProblem& problem) const = 0;

private:
  const nlohmann::json& of_type(const nlohmann::json& object, const std::string& key,
                                const std::string& field, nlohmann::json::value_t type,
                                const char* expected) const {
    const auto& v = at(object, key, field);
    if (v.type() != type)
      fail(field_path(field, key),
           FieldProblem{.kind = FieldProblem::Kind::wrong_type, .value = &v, .expected = expected});
    return v;
  }

  template <class T>
  struct is_vector : std::false_type {};
  template <class T, class A>
  struct is_vector<std::vector<T, A>> : std::true_type {};

  template <class T>
  static std::string expected_of() {
    if constexpr (std::is_same_v<T, std::string>)
      return "a string";
    else if constexpr (std::is_same_v<T, bool>)
      return "true or false";
    else if constexpr (std::is_integral_v<T>)
      return "an integer";
    else if constexpr (std::is_floating_point_v<T>)
      return "a number";
    else if constexpr (is_vector<T>::value)
      return "an array";
    else
      return "an object";
  }

  template <class T>
  void check_numbers(const nlohmann::json& v, const std::string& field) const {
    if constexpr (is_vector<T>::value) {
      if (v.is_array())
        for (const auto& element : v)
          check_numbers<typename T::value_type>(element, field);
    } else if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
      if (v.is_boolean())
        fail(field, FieldProblem{.kind = FieldProblem::Kind::wrong_type,
                                 .value = &v,
                                 .expected = expected_of<T>()});
      if constexpr (std::is_integral_v<T>) {
        if (!v.is_number())
          return; // nlohmann's own type error follows
        if (!v.is_number_integer())
          fail(field, FieldProblem{.kind = FieldProblem::Kind::not_integer,
                                   .value = &v,
                                   .expected = "an integer"});
        const bool fits = v.is_number_unsigned() ? std::in_range<T>(v.get<std::uint64_t>())
                                                 : std::in_range<T>(v.get<std::int64_t>());
        if (!fits)
          fail(field, FieldProblem{.kind = FieldProblem::Kind::out_of_range,
                                   .value = &v,
                                   .expected = fmt::format("an integer from {} to {}",
                                                           std::numeric_limits<T>::min(),
                                                           std::numeric_limits<T>::max())});
      }
    }
  }
};

} // namespace neml2::detail
